"""A stage's code deps are derived from its imports (tasks/common/stage_code.py), dvc.yaml lists exactly them, and
`eaglet dvc sync` rewrites only the lists it owns."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.dvc_sync import SYNC_COMMAND, stale_stages, synced_text
from flows.stage_cache import DVC_FILE
from tasks.common.stage_code import (EXEMPT, PROJECT_PACKAGES, REPO_ROOT, STAGE_FILES, StageCodeError, derive_code_deps,
                              stage_code_deps)
from flows.stages import STAGE_ORDER

TREE = {
    "contract/__init__.py": "VERSION = 1\n",
    "contract/deep.py": "VALUE = 1\n",
    "contract/unused.py": "VALUE = 2\n",
    "models/__init__.py": "",
    "models/thing.py": "from contract import deep\n",
    "tasks/__init__.py": "",
    "tasks/common/__init__.py": "",
    "tasks/common/helper.py": "import models.thing\n",
    "tasks/common/progress.py": "BAR = None\n",
    "tasks/data/__init__.py": "",
    "tasks/data/journal.py": "from ..common.helper import models\n",
    "tasks/mystage.py": ("from tasks.common import progress\n\n\ndef run(cfg):\n"
                         "    from tasks.data import journal  # lazily, as stages do\n    return journal\n"),
}


def plant(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_module_a_stage_imports_anywhere_is_in_its_deps(tmp_path: Path) -> None:
    deps = derive_code_deps("tasks.mystage", (), plant(tmp_path, TREE))
    assert deps == ("contract/__init__.py", "contract/deep.py", "models/thing.py", "tasks/common/helper.py",
                    "tasks/data/journal.py", "tasks/mystage.py"), \
        "lazy, `from pkg import module`, relative and transitive imports count; exempt progress and empty inits do not"


def test_a_declared_file_is_a_dep_and_its_imports_are_followed(tmp_path: Path) -> None:
    plant(tmp_path, {**TREE, "tasks/plugins/loaded_by_path.py": "from contract import unused\n",
                     "tasks/suite.json": "{}"})
    deps = derive_code_deps("tasks.mystage", ("tasks/plugins/loaded_by_path.py", "tasks/suite.json"), tmp_path)
    assert {"tasks/plugins/loaded_by_path.py", "contract/unused.py", "tasks/suite.json"} <= set(deps)


def test_an_import_by_name_or_of_no_module_is_refused(tmp_path: Path) -> None:
    plant(tmp_path, {**TREE, "tasks/mystage.py": "import importlib\n\nimportlib.import_module('tasks.data.journal')\n"})
    with pytest.raises(StageCodeError, match=r"tasks/mystage.py:3 imports a module by name; declare .*IMPORTS"):
        derive_code_deps("tasks.mystage", (), tmp_path)
    plant(tmp_path, {"tasks/mystage.py": "from tasks.data.gone import x\n"})
    with pytest.raises(StageCodeError, match=r"tasks/mystage.py:1 imports tasks.data.gone, which is no module"):
        derive_code_deps("tasks.mystage", (), tmp_path)


def test_dvc_yaml_lists_each_stages_derived_code_and_declared_reads() -> None:
    stale = stale_stages(DVC_FILE.read_text(encoding="utf-8"))
    assert not stale, (f"dvc.yaml's lists differ from the code's imports or STAGE_READS ({', '.join(stale)}): "
                       f"run `{SYNC_COMMAND}`")


def test_sync_rewrites_the_deps_and_keeps_everything_else() -> None:
    text = DVC_FILE.read_text(encoding="utf-8")
    assert "      - tasks/regenerate.py\n" in text and text.startswith("#")
    edited = text.replace("      - tasks/regenerate.py\n", "", 1).replace("      - contract/config.py\n",
                                                                          "      - contract/nothing.py\n", 1)
    assert stale_stages(edited) == ["target.deps", "regenerate.deps"]
    assert synced_text(edited) == text, "comments, cmd, outs, metrics and plots stay byte for byte"
    result = CliRunner().invoke(app, ["dvc", "sync", "--check"])
    assert result.exit_code == 0, result.output


def test_every_stage_runs_its_own_module_and_the_known_modules_it_needs() -> None:
    for name in STAGE_ORDER:
        assert f"tasks/{name}.py" in stage_code_deps(name)
    assert "models/target_families.py" in stage_code_deps("capture")
    assert {"contract/chat_rendering.py", "tasks/data/journal.py"} <= set(stage_code_deps("regenerate"))
    assert {"models/eagle3.py", "models/draft_checkpoint.py"} <= set(stage_code_deps("evaluate"))
    assert {"tasks/serving/serving_setting.py", "tasks/serving/speedup_model.py"} <= set(stage_code_deps("benchmark"))


def test_the_exempt_and_declared_files_exist() -> None:
    for path, reason in EXEMPT.items():
        assert (REPO_ROOT / path).is_file() and path.split("/")[0] in PROJECT_PACKAGES, f"EXEMPT names {path}"
        assert reason, f"EXEMPT gives no reason for {path}"
    for stage, files in STAGE_FILES.items():
        assert stage in STAGE_ORDER, f"STAGE_FILES names no stage {stage}"
        for path in files:
            assert (REPO_ROOT / path).is_file(), f"STAGE_FILES[{stage!r}] names {path}, which does not exist"
