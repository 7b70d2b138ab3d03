"""The README names only things that exist: repository paths, `eaglet` commands, config fields, python modules and
make targets. docs/*.md are held to their repository paths. A failure lists each bad name with its file and line.

Names are read from inline code spans and link targets (and, for commands and `--config` paths, from code blocks).
A path whose first part is an artifact folder of a run (`draft/vllm/`, `benchmark/report.json`: dvc.yaml's
`${output_dir}/...` outputs) or holds a placeholder (`<run_id>`) names no repository file and is not checked.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import typer.main

from contract.config import RunConfig
from contract.config_reference import is_config_field

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

#: Run outputs that dvc.yaml does not list (the MLflow store, the run's written config, the artifact root itself).
OTHER_OUTPUT_ROOTS = {"artifacts", "mlflow.db", "mlartifacts", "config", "logs", ".prefect-results", ".eaglet.lock",
                      "roofline.json", "roofline.png", "checkpoints.superseded-<time>"}
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".json", ".jsonl", ".sh", ".cfg", ".txt")
MODULE_PACKAGES = ("contract", "models", "tasks", "flows", "expectations", "benchmarks", "tests")


@dataclass(frozen=True)
class Name:
    """One name a document uses: its text, where it stands and whether it sits in a code block."""

    text: str
    line: int
    in_block: bool


def output_roots() -> set[str]:
    """First parts of the paths a run writes under output_dir, from dvc.yaml's `${output_dir}/...` entries."""
    found = re.findall(r"\$\{output_dir\}/([^/\s:]+)", (ROOT / "dvc.yaml").read_text(encoding="utf-8"))
    return set(found) | OTHER_OUTPUT_ROOTS


def names(path: Path) -> Iterator[Name]:
    """Inline code spans and link targets outside code blocks; whole lines inside them."""
    in_block = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            yield Name(line, number, True)
            continue
        for span in re.findall(r"`([^`]+)`", line):
            yield Name(span.strip(), number, False)
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if "://" not in target and not target.startswith("#"):
                yield Name(target.split("#")[0], number, False)


def expanded(pattern: str) -> list[str]:
    """`draft/{sglang,vllm}/` as its alternatives."""
    match = re.search(r"\{([^{}]*,[^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    return [alternative for option in match.group(1).split(",")
            for alternative in expanded(pattern[:match.start()] + option + pattern[match.end():])]


def path_exists(relative: str, base: Path) -> bool:
    """Whether a repository path (glob and brace patterns allowed) names something that exists."""
    for candidate in expanded(relative.rstrip("/")):
        if any(character in candidate for character in "*?["):
            if any(base.glob(candidate)) or any(ROOT.glob(candidate)):
                continue
            return False
        if not ((base / candidate).exists() or (ROOT / candidate).exists()):
            return False
    return True


def repository_path(text: str) -> str | None:
    """`text` if it reads as a repository path: a relative path with a slash, or a file name with a known suffix."""
    if " " in text or "://" in text or text.startswith(("-", "$", "~", "/", "models:")) or "=" in text:
        return None
    if "<" in text or "NAME" in text:
        return None  # a placeholder: a pattern, not one path
    if "/" in text or text.endswith(FILE_SUFFIXES) or text in {"Makefile"}:
        return text
    return None


def path_problem(text: str, base: Path, roots: set[str]) -> str | None:
    """Why `text` names no repository path, or None (also for names that are not repository paths)."""
    path = repository_path(text)
    if path is None or path.split("/")[0] in roots or path.startswith("./artifacts"):
        return None
    if path.split("/")[0] in {"..", "."}:
        path = str((base / path).resolve().relative_to(ROOT)) if (base / path).resolve().is_relative_to(ROOT) else path
    if "/" not in path and path.endswith((".json", ".jsonl", ".safetensors", ".png", ".html")):
        return None  # a bare artifact file name (contract.json inside an export), not a repository file
    return None if path_exists(path, base) else f"no such path: {path}"


def cli_tree() -> Any:
    """The `eaglet` command tree (typer's click group: typer 0.29 vendors click, so groups are told by their
    `commands`, not by class)."""
    from flows.cli import app

    return typer.main.get_command(app)


def is_group(command: Any) -> bool:
    return isinstance(getattr(command, "commands", None), dict)


def command_problem(words: list[str], group: Any) -> str | None:
    """Why `eaglet <words>` is no command of the CLI, or None."""
    from flows.stages import STAGE_ORDER

    command = group
    path: list[str] = []
    for word in words:
        if not is_group(command):
            break
        sub = command.commands.get(word)
        if sub is None:
            return f"no such command: eaglet {' '.join(path + [word])}"
        path.append(word)
        command = sub
    if is_group(command):
        return f"eaglet {' '.join(path)} needs a subcommand (one of {', '.join(sorted(command.commands))})"
    if path == ["stage"] and len(words) > 1 and words[1].isidentifier() and words[1].islower():
        if words[1] not in STAGE_ORDER:
            return f"no such stage: eaglet stage {words[1]}"
    return None


def eaglet_commands(text: str) -> Iterator[list[str]]:
    """The words after each `eaglet` in `text` up to the first option, path, placeholder or comment."""
    for match in re.finditer(r"(?:^|[\s/`(])eaglet\s+([a-z][\w\- :./=@]*)", text):
        words = []
        for word in match.group(1).split():
            if not re.fullmatch(r"[a-z][a-z0-9_-]*", word):
                break
            words.append(word)
        if words:
            yield words


def config_field(text: str) -> str | None:
    """`text` (an override's key, or the name alone) if it starts with a section of RunConfig and reads as a field."""
    key = text.split("=", 1)[0].split(":", 1)[0].strip()
    first = key.split(".", 1)[0].removesuffix("[]")
    if "." not in key or first not in RunConfig.model_fields or " " in key or "/" in key:
        return None
    if key.endswith((".safetensors", ".json", ".yaml", ".py", ".md", ".png")):
        return None  # a file (model.safetensors), not a field
    return key


def module_problem(text: str) -> str | None:
    """Why a dotted `package.module[.attribute]` names nothing, or None (also for text that is not such a name)."""
    if not re.fullmatch(r"[a-z_]+(\.[A-Za-z_][A-Za-z0-9_]*)+", text) or text.split(".")[0] not in MODULE_PACKAGES:
        return None
    if text.endswith(FILE_SUFFIXES + (".safetensors", ".png", ".html")):
        return None  # a file name (contract.json), not a module
    parts = text.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[cut:]
            if not rest:
                return None
            if len(rest) == 1 and rest[0] in defined_names(module):
                return None
            return f"{'.'.join(parts[:cut])} defines no {'.'.join(rest)}"
    return f"no such module: {text}"


def defined_names(module: Path) -> set[str]:
    """Top-level functions, classes and assignments of a module."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found |= {target.id for target in targets if isinstance(target, ast.Name)}
    return found


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.MULTILINE))


def readme_problems(path: Path = README) -> list[str]:
    """Every name of the document that names nothing, as `file:line: why`."""
    roots, group, targets = output_roots(), cli_tree(), make_targets()
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    problems: list[str] = []
    for name in names(path):
        found: list[str | None] = []
        for words in eaglet_commands(name.text.split(" #")[0] if name.in_block else name.text):
            found.append(command_problem(words, group))
        for target in re.findall(r"\bmake\s+([a-z][\w-]*)", name.text):
            found.append(None if target in targets else f"no such make target: make {target}")
        if name.in_block:
            found += [path_problem(config, path.parent, roots) for config in re.findall(r"--config\s+(\S+)", name.text)]
        else:
            found.append(path_problem(name.text, path.parent, roots))
            field = config_field(name.text)
            if field is not None and not is_config_field(field):
                found.append(f"no such config field: {field}")
            found.append(module_problem(name.text))
        problems += [f"{where}:{name.line}: {problem}" for problem in found if problem]
    return problems


def docs_path_problems() -> list[str]:
    """docs/*.md: every path in code spans and links that starts at a folder of the repository (`tasks/...`,
    `docs/...`) or a sibling page (`measurements.md`) exists. Other names are the README's test's job."""
    roots = output_roots()
    folders = {entry.name for entry in ROOT.iterdir() if entry.is_dir() and not entry.name.startswith(".")}
    problems = []
    for doc in DOCS:
        for name in names(doc):
            first = name.text.split("/", 1)[0]
            local = first in folders and "/" in name.text or name.text.endswith(".md")
            problem = None if name.in_block or not local else path_problem(name.text, doc.parent, roots)
            if problem:
                problems.append(f"{doc.relative_to(ROOT)}:{name.line}: {problem}")
    return problems


def test_the_readme_names_only_what_exists() -> None:
    problems = readme_problems()
    assert not problems, "README.md names things that do not exist:\n" + "\n".join(problems)


def test_the_docs_name_only_paths_that_exist() -> None:
    problems = docs_path_problems()
    assert not problems, "docs/ name paths that do not exist:\n" + "\n".join(problems)


def test_the_readme_fits_a_newcomers_first_look() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; keep it to 150 and move detail to docs/"


def test_the_checker_catches_each_kind_of_bad_name(tmp_path: Path) -> None:
    planted = tmp_path / "PLANTED.md"
    planted.write_text("\n".join([
        "Edit `configs/no-such-recipe.yaml` or [this](docs/nowhere.md); see `tasks/serving/`.",
        "Set `evaluation.sets_onn` or `capture.eval_records` or `runtime.engines.vllm.python`.",
        "Run `eaglet config frobnicate`, `eaglet registry show`, `eaglet stage ingest` and `make run`.",
        "Read `tasks.serving.no_such_module`, `tasks.registry.store.download_drafter` and `tasks.register.nothing_here`.",
        "```bash", "eaglet nosuch --config params.yaml", "eaglet run --config configs/missing.yaml", "```",
    ]) + "\n", encoding="utf-8")
    problems = readme_problems(planted)
    assert problems == [
        "PLANTED.md:1: no such path: configs/no-such-recipe.yaml",
        "PLANTED.md:1: no such path: docs/nowhere.md",
        "PLANTED.md:2: no such config field: evaluation.sets_onn",
        "PLANTED.md:3: no such command: eaglet config frobnicate",
        "PLANTED.md:4: tasks.serving defines no no_such_module",
        "PLANTED.md:4: tasks.register defines no nothing_here",
        "PLANTED.md:6: no such command: eaglet nosuch",
        "PLANTED.md:7: no such path: configs/missing.yaml",
    ]


def test_config_fields_resolve_through_lists_and_mappings() -> None:
    good = ["model.source", "data.sources[].every", "deployment.trainer.nproc_per_node", "runtime.engines.<engine>.env",
            "runtime.engines.sglang.python", "registry.waive_gates.speedup", "capture"]
    bad = ["model.sauce", "runtime.engines.tgi.python", "deployment.trainer.nproc_per_node.x", "data.sources[].nope"]
    assert [field for field in good if not is_config_field(field)] == []
    assert [field for field in bad if is_config_field(field)] == []

