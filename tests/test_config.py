"""The run contract: loading, overrides, and every kind of rejection, each naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from contract.config import RunConfig, draft_tree_capacity
from contract.config_loading import ConfigError, config_as_yaml, flatten_config, load_config
from flows.cli import app

REPO_ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ["model", "data", "regeneration", "validation", "capture", "training", "evaluation",
            "benchmark", "tracking", "registry", "deployment", "runtime"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_every_section_exists_and_defaults_validate() -> None:
    cfg = load_config(None)
    for section in SECTIONS:
        assert hasattr(cfg, section), section
    assert cfg.run_id == "embedded-default"
    assert cfg.output_path == Path("artifacts/embedded-default")


@pytest.mark.parametrize("name", ["params.yaml", "configs/embedded-default.yaml", "configs/ci-tiny.yaml", "configs/showcase-cpu.yaml",
                                  "configs/llama31-8b-sglang.yaml"])
def test_shipped_configs_validate(name: str) -> None:
    cfg = load_config(REPO_ROOT / name)
    assert cfg.run_id
    assert cfg.data.sources, f"{name} ingests nothing"


def test_gpu_recipe_is_the_real_thing() -> None:
    cfg = load_config(REPO_ROOT / "configs/llama31-8b-sglang.yaml")
    assert cfg.model.source == "hub" and cfg.model.id == "meta-llama/Llama-3.1-8B-Instruct"
    assert cfg.benchmark.engines == ["sglang"]
    assert cfg.deployment.trainer.nproc_per_node == 8


def test_params_yaml_is_the_embedded_default() -> None:
    cfg = load_config(REPO_ROOT / "params.yaml")
    assert cfg.model.source == "embedded"
    assert (REPO_ROOT / "configs/embedded-default.yaml").resolve() == (REPO_ROOT / "params.yaml").resolve()
    mtbench = [source for source in cfg.data.sources if source.asset == "mtbench"]
    assert mtbench and mtbench[0].split == "eval"


def test_overrides_keep_yaml_types(tmp_path: Path) -> None:
    path = write(tmp_path, "run_id: base\ntraining:\n  learning_rate: 0.001\n")
    cfg = load_config(path, ["training.learning_rate=3e-4", "training.ttt_length=5", "tracking.enabled=false",
                             "capture.aux_layer_ids=[1, 2, 3]", "run_id=override"])
    assert cfg.training.learning_rate == pytest.approx(3e-4)
    assert cfg.training.ttt_length == 5
    assert cfg.tracking.enabled is False
    assert cfg.capture.aux_layer_ids == [1, 2, 3]
    assert cfg.run_id == "override"


def test_round_trip_through_yaml(tmp_path: Path) -> None:
    cfg = load_config(REPO_ROOT / "configs/llama31-8b-sglang.yaml")
    again = load_config(write(tmp_path, config_as_yaml(cfg)))
    assert again.model_copy(update={"runtime": cfg.runtime}) == cfg, "all but the secrets come back"
    assert again.runtime.engines["vllm"].env == {"VLLM_CPU_KVCACHE_SPACE": "***"}, "engine env values come back redacted"
    flat = flatten_config(cfg)
    assert flat["training.ttt_length"] == "7"
    assert flat["deployment.trainer.nproc_per_node"] == "8"


def rejection(tmp_path: Path, text: str, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text), overrides or [])
    return str(caught.value)


def test_misspelt_key_suggests_the_right_one(tmp_path: Path) -> None:
    message = rejection(tmp_path, "training:\n  lerning_rate: 0.1\n")
    assert "run.yaml" in message
    assert "unknown field 'lerning_rate' in training; did you mean 'learning_rate'?" in message


def test_misspelt_section_and_nested_keys(tmp_path: Path) -> None:
    assert "unknown field 'trainng' in the run config; did you mean 'training'?" in rejection(tmp_path, "trainng: {}\n")
    nested = rejection(tmp_path, "deployment:\n  trainer:\n    nproc_per_nod: 2\n")
    assert "deployment.trainer" in nested and "did you mean 'nproc_per_node'?" in nested
    in_list = rejection(tmp_path, "data:\n  sources:\n    - name: a\n      path: x.jsonl\n      limt: 3\n")
    assert "data.sources.0" in in_list and "did you mean 'limit'?" in in_list


def test_wrong_types_and_ranges_name_the_field(tmp_path: Path) -> None:
    message = rejection(tmp_path, "training:\n  learning_rate: fast\n  ttt_length: 0\n")
    assert "training.learning_rate" in message and "'fast'" in message
    assert "training.ttt_length" in message
    assert "regeneration.backend" in rejection(tmp_path, "regeneration:\n  backend: carrier-pigeon\n")


def test_semantic_rules(tmp_path: Path) -> None:
    assert "needs model.path" in rejection(tmp_path, "model:\n  source: local\n")
    assert "exactly one of 'path' or 'asset'" in rejection(tmp_path, "data:\n  sources:\n    - name: a\n")
    duplicate = "data:\n  sources:\n    - {name: a, asset: mtbench}\n    - {name: a, asset: humaneval}\n"
    assert "repeated: a" in rejection(tmp_path, duplicate)
    assert "evaluation.sets is empty" in rejection(tmp_path, "evaluation:\n  sets_on: engine\n")
    assert load_config(None, ["evaluation.sets=[{source: mtbench}]", "evaluation.sets_on=engine",
                              "benchmark.engines=[vllm]"]).evaluation.sets_on == "engine"


def test_aux_layer_ids_are_three_ascending_layers(tmp_path: Path) -> None:
    """The drafter's fc fuses exactly three layers (Linear(3H -> H)); engines capture each once, in order."""
    two = rejection(tmp_path, "", ["capture.aux_layer_ids=[1, 2]"])
    assert "capture.aux_layer_ids: needs exactly 3 decoder layer ids" in two and "got 2: [1, 2]" in two
    assert "capture.aux_layer_ids: needs exactly 3" in rejection(tmp_path, "", ["capture.aux_layer_ids=[1, 2, 3, 4]"])
    assert "capture.aux_layer_ids: ids are 0-indexed" in rejection(tmp_path, "", ["capture.aux_layer_ids=[-1, 2, 3]"])
    assert "capture.aux_layer_ids: must be strictly ascending" in rejection(tmp_path, "", ["capture.aux_layer_ids=[3, 2, 4]"])
    assert "capture.aux_layer_ids: must be strictly ascending" in rejection(tmp_path, "", ["capture.aux_layer_ids=[1, 2, 2]"])
    assert load_config(None, ["capture.aux_layer_ids=[0, 5, 9]"]).capture.aux_layer_ids == [0, 5, 9]


def test_tree_settings_must_form_a_tree(tmp_path: Path) -> None:
    """SGLang verifies the root plus the best N - 1 of the topk + (steps - 1) * topk^2 drafted candidates."""
    assert draft_tree_capacity(steps=2, topk=2) == 7 and draft_tree_capacity(steps=3, topk=4) == 37
    assert draft_tree_capacity(steps=5, topk=1) == 6, "a chain verifies steps + 1"
    too_many = rejection(tmp_path, "evaluation:\n  steps: 2\n  topk: 2\n  num_draft_tokens: 8\n")
    assert "evaluation.num_draft_tokens: 8 cannot be verified by a tree of steps 2 x topk 2: it verifies 2..7 tokens" in too_many
    assert "evaluation.num_draft_tokens: 1 cannot be verified" in rejection(tmp_path, "", ["evaluation.topk=2", "evaluation.num_draft_tokens=1"])
    assert load_config(None, ["evaluation.steps=2", "evaluation.topk=2", "evaluation.num_draft_tokens=7"])
    chain = load_config(None, ["evaluation.steps=6", "evaluation.topk=1"])
    assert chain.evaluation.num_draft_tokens == 4, "a chain verifies steps + 1 whatever num_draft_tokens says"
    trees = "benchmark:\n  sglang_trees:\n    - {steps: 3, topk: 4, num_draft_tokens: 16}\n    - {steps: 2, topk: 2, num_draft_tokens: 9}\n"
    message = rejection(tmp_path, trees)
    assert "benchmark.sglang_trees.1.num_draft_tokens: 9 cannot be verified by a tree of steps 2 x topk 2" in message
    assert "sglang_trees.0" not in message, "SGLang's documented steps 3, topk 4, 16 draft tokens is a tree"
    listed = load_config(None, ["benchmark.config_list=['1,3,1,4', '8,3,4,8', '8,5,1,6']"]).benchmark
    assert listed.concurrency == [1, 4, 8] and listed.num_speculative_tokens == [3, 5]
    assert [(tree.steps, tree.topk, tree.num_draft_tokens) for tree in listed.sglang_trees] == [(3, 4, 8)]
    assert "a chain (topk 1) of 3 steps verifies 4 tokens, not 5" in rejection(
        tmp_path, "", ["benchmark.config_list=['1,3,1,5']"])
    assert "is not 'batch,steps,topk,num_draft_tokens'" in rejection(tmp_path, "", ["benchmark.config_list=['1,3']"])
    assert "cannot be verified by a tree of steps 2 x topk 2" in rejection(
        tmp_path, "", ["benchmark.config_list=['1,2,2,9']"])


def test_resume_from_is_a_mode_or_a_checkpoint_path(tmp_path: Path) -> None:
    """The retired `latest` and `null` fail naming the field and what it takes; a path is taken as given."""
    for value in ("latest", "null", "step-00000100"):
        message = rejection(tmp_path, f"training:\n  resume_from: {value}\n")
        assert "training.resume_from: " in message and "is not one of auto, none or the path of a checkpoint" in message
    for value in ("auto", "none", "/data/run/checkpoints/step-00000100", "checkpoints/step-00000100"):
        assert load_config(None, [f"training.resume_from={value}"]).training.resume_from == value


def test_bad_files_and_bad_overrides(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    assert "not valid YAML" in rejection(tmp_path, "training: [unclosed\n")
    assert "top level must be a mapping" in rejection(tmp_path, "- a\n- b\n")
    assert "expected section.field=value" in rejection(tmp_path, "", ["training.learning_rate"])
    assert "is a value, not a section" in rejection(tmp_path, "run_id: a\n", ["run_id.x=1"])
    assert "did you mean 'max_steps'" in rejection(tmp_path, "", ["training.max_step=3"])


def test_cli_config_commands(tmp_path: Path) -> None:
    runner = CliRunner()
    shown = runner.invoke(app, ["config", "show", "--config", str(REPO_ROOT / "params.yaml"), "training.ttt_length=5"])
    assert shown.exit_code == 0, shown.output
    assert RunConfig.model_validate(__import__("yaml").safe_load(shown.output)).training.ttt_length == 5
    bad = runner.invoke(app, ["config", "validate", "--config", str(write(tmp_path, "training:\n  lerning_rate: 1\n"))])
    assert bad.exit_code == 2
    assert "did you mean 'learning_rate'" in bad.output
    good = runner.invoke(app, ["config", "validate", "--config", str(REPO_ROOT / "configs/ci-tiny.yaml")])
    assert good.exit_code == 0 and "ok" in good.output


def test_yaml_12_booleans_so_dvc_rewritten_params_still_load(tmp_path) -> None:
    """`dvc exp run -S` rewrites params.yaml in YAML 1.2 and leaves `off` unquoted: it must stay the string."""
    from contract.config_loading import load_config

    path = tmp_path / "params.yaml"
    path.write_text("regeneration:\n  reasoning: off\ntracking:\n  enabled: false\n")
    cfg = load_config(path, ["regeneration.supervise=last"])
    assert cfg.regeneration.reasoning == "off" and cfg.tracking.enabled is False
    assert load_config(path, ["regeneration.reasoning=save"]).regeneration.reasoning == "save"


def test_an_engine_override_changes_one_field_and_keeps_the_engines_defaults(tmp_path: Path) -> None:
    cfg = load_config(None, ["runtime.engines.vllm.port=8200", "runtime.engines.vllm.env.OMP_NUM_THREADS=2"])
    vllm = cfg.runtime.engines["vllm"]
    assert vllm.port == 8200 and vllm.python == ".venv-vllm/bin/python"
    assert vllm.env == {"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": "2"}
    assert cfg.runtime.engines["sglang"].python == ".venv-sglang/bin/python", "the other engine is still configured"
    partial = tmp_path / "run.yaml"
    partial.write_text("runtime:\n  engines:\n    sglang:\n      port: 31000\n")
    from_file = load_config(partial)
    assert from_file.runtime.engines["sglang"].port == 31000 and from_file.runtime.engines["vllm"].port == 8100
    assert RunConfig.model_validate(from_file.model_dump(mode="json")) == from_file, "a dumped config reads back as is"
    stages = load_config(None, ["regeneration.engine_env.VLLM_CPU_NUM_OF_RESERVED_CPU=0",
                                "capture.engine_env.VLLM_CPU_NUM_OF_RESERVED_CPU=0"])
    assert stages.regeneration.engine_env == stages.capture.engine_env == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def test_work_pools_name_stages_that_exist(tmp_path: Path) -> None:
    placed = load_config(write(tmp_path, "deployment:\n  work_pools: {train: gpu, capture: gpu}\n"), [])
    assert placed.deployment.work_pools == {"train": "gpu", "capture": "gpu"}
    message = rejection(tmp_path, "deployment:\n  work_pools: {trian: gpu}\n")
    assert "deployment.work_pools" in message and "trian" in message and "'train'" in message, message


@pytest.mark.parametrize("settings, message", [
    ({"draft": {"method": "dflash"}, "evaluation": {"topk": 2}}, "draft.method dflash drafts a chain"),
    ({"draft": {"method": "dflash"}, "benchmark": {"engines": ["sglang"]}}, "served by vLLM only"),
    ({"draft": {"method": "dflash"}, "training": {"compile": True}}, "dflash trains eagerly"),
    ({"draft": {"method": "dflash"}, "training": {"ttt_length": 2}, "evaluation": {"steps": 3}},
     "blocks of training.ttt_length 2 mask slots: it cannot draft 3 tokens"),
    ({"draft": {"method": "dflash"}, "training": {"ttt_length": 3}, "benchmark": {"num_speculative_tokens": [2, 4]}},
     "cannot draft 4 tokens"),
    ({"draft": {"method": "eagle3", "num_layers": 2}}, "the eagle3 draft has exactly one layer"),
])
def test_a_dflash_setting_it_cannot_train_or_serve_is_refused(settings: dict, message: str) -> None:
    """DFlash drafts a chain on vLLM, trains eagerly, and cannot draft more tokens than its block has mask slots;
    only DFlash has several layers."""
    base = {"evaluation": {"topk": 1, "steps": 3}, "training": {"ttt_length": 3}}
    merged = {section: {**base.get(section, {}), **settings.get(section, {})} for section in {*base, *settings}}
    with pytest.raises(ValueError, match=message):
        RunConfig.model_validate(merged)
    RunConfig.model_validate({**base, "draft": {"method": "dflash", "num_layers": 2}})  # the same, allowed
