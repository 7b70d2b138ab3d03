"""The code each stage runs, derived from its imports, so that no edit to it can reuse a stale result.

A stage's code deps are every project module `tasks/<stage>.py` imports, directly or through others, at any depth
(stages import heavy libraries lazily, inside functions), with the `__init__.py` of every package on the way, plus
the files it needs that no import names (`STAGE_FILES`), less the modules that cannot change its outputs
(`EXEMPT`). dvc.yaml's code deps are written from here (`eaglet dvc sync`) and the Prefect cache key
(flows/stage_cache.py) hashes the same list, so the two agree; tests/test_stage_code.py fails when dvc.yaml drifts.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Packages whose modules can change a stage's outputs (flows/ only runs stages; libraries are pinned elsewhere).
PROJECT_PACKAGES: tuple[str, ...] = ("contract", "models", "tasks", "expectations")

#: Files a stage needs that no import names; a .py file here has its imports followed too.
STAGE_FILES: dict[str, tuple[str, ...]] = {
    # the Great Expectations suites, read by path
    "validate": ("expectations/regenerated_records.json", "expectations/train_eval_split.json",
                 "expectations/decontamination.json"),
    "capture": ("tasks/serving/vllm_plugins/eaglet_hidden_states.py",),  # loaded by the vLLM engine process by path
    "train": ("tasks/serving/vllm_plugins/eaglet_hidden_states.py",),  # online training captures through it too
}

#: Modules that cannot change any stage's outputs, left out of every stage's deps (editing them reruns nothing).
EXEMPT: dict[str, str] = {
    "tasks/common/progress.py": "draws progress bars on the terminal; writes no artifact",
    "tasks/common/run_lock.py": "keeps two runs out of one output_dir; changes no file a stage writes",
    "tasks/common/mlflow_store.py": "says where MLflow keeps its records; the stage's artifacts do not depend on it",
}

#: Modules that load others by name at run time (importlib.import_module, __import__), with the modules they load.
DYNAMIC_IMPORTS: dict[str, tuple[str, ...]] = {}

DYNAMIC_IMPORT_CALLS = ("import_module", "__import__")


class StageCodeError(RuntimeError):
    """The import closure cannot be derived: a project import names no module, or a module imports by name."""


@dataclass(frozen=True)
class ModuleIndex:
    """Every project module by dotted name, with its file relative to the root (`pkg` -> `pkg/__init__.py`)."""

    root: Path
    files: dict[str, str]

    @classmethod
    def scan(cls, root: Path) -> "ModuleIndex":
        files: dict[str, str] = {}
        for package in PROJECT_PACKAGES:
            for path in sorted((root / package).rglob("*.py")):
                relative = path.relative_to(root)
                if "__pycache__" in relative.parts:
                    continue
                parts = list(relative.with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                files[".".join(parts)] = relative.as_posix()
        return cls(root, files)

    def module_of(self, file: str) -> str:
        """The dotted name of a project file (a declared .py file)."""
        for name, path in self.files.items():
            if path == file:
                return name
        raise StageCodeError(f"{file} is not a Python module of {', '.join(PROJECT_PACKAGES)} under {self.root}")


def is_project(name: str) -> bool:
    return name.split(".")[0] in PROJECT_PACKAGES


def with_parents(name: str) -> list[str]:
    """`a.b.c` and the packages importing it runs first: a, a.b, a.b.c."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts) + 1)]


def from_base(node: ast.ImportFrom, module: str, file: str) -> str:
    """The module a `from X import ...` names, relative imports resolved against the importing package."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if file.endswith("__init__.py") else module.split(".")[:-1]
    kept = package[:len(package) - (node.level - 1)]
    return ".".join([*kept, *([node.module] if node.module else [])])


def imported_modules(module: str, index: ModuleIndex) -> set[str]:
    """The project modules one module imports anywhere in its file (a function body counts: stages import lazily)."""
    file = index.files[module]
    tree = ast.parse((index.root / file).read_text(encoding="utf-8"), filename=file)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, module, file)
            named = [base, *(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in index.files)]
        elif isinstance(node, ast.Call) and call_name(node) in DYNAMIC_IMPORT_CALLS and file not in DYNAMIC_IMPORTS:
            raise StageCodeError(f"{file}:{node.lineno} imports a module by name; declare what it loads in "
                                 f"DYNAMIC_IMPORTS in {__name__}")
        else:
            continue
        for name in filter(is_project, named):
            if name not in index.files:
                raise StageCodeError(f"{file}:{node.lineno} imports {name}, which is no module under {index.root}")
            found.update(with_parents(name))
    found.update(DYNAMIC_IMPORTS.get(file, ()))
    return found


def call_name(node: ast.Call) -> str:
    """The called name of `f(...)` or `x.f(...)`."""
    function = node.func
    return function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")


def import_closure(roots: list[str], index: ModuleIndex) -> set[str]:
    """Every project module running `roots` executes: their imports, those modules' imports, and so on."""
    seen: set[str] = set()
    waiting = [name for root in roots for name in with_parents(root) if name in index.files]
    while waiting:
        module = waiting.pop()
        if module not in seen:
            seen.add(module)
            waiting += sorted(imported_modules(module, index) - seen)
    return seen


@lru_cache(maxsize=4)
def module_index(root: Path) -> ModuleIndex:
    """The project's modules under `root`, scanned once per process (every stage's closure walks the same files)."""
    return ModuleIndex.scan(root)


def derive_code_deps(stage_module: str, files: tuple[str, ...], root: Path) -> tuple[str, ...]:
    """Sorted repository paths of the code `stage_module` runs plus `files`, without EXEMPT modules."""
    index = module_index(root)
    if stage_module not in index.files:
        raise StageCodeError(f"stage module {stage_module} has no file under {root}")
    roots = [stage_module, *(index.module_of(file) for file in files if file.endswith(".py"))]
    paths = {index.files[module] for module in import_closure(roots, index)} | set(files)
    return tuple(sorted(path for path in paths - set(EXEMPT) if not empty_init(root / path)))


def empty_init(path: Path) -> bool:
    """An empty package `__init__.py` runs nothing (and DVC warns about empty deps); once it holds code it is a dep."""
    return path.name == "__init__.py" and not path.read_text(encoding="utf-8").strip()


@lru_cache(maxsize=None)
def stage_code_deps(stage: str) -> tuple[str, ...]:
    """The code deps of stage `stage` (tasks/<stage>.py), as dvc.yaml lists them (computed once per process)."""
    return derive_code_deps(f"tasks.{stage}", STAGE_FILES.get(stage, ()), REPO_ROOT)
