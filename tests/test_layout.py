"""Package layering: each module imports only its own layer or lower ones, and nothing imports in a circle.

Layers, lowest first:
  0  contract, contract.*
  1  models.*
  2  expectations.* and the tasks subpackages tasks.<sub>.* (tasks.common, tasks.data, ...)
  3  the stage modules in STAGES (and the empty tasks/__init__.py)
  4  flows.*
Extra rules: a stage never imports another stage; tasks.common.* (the bottom plumbing) imports only
contract, models and tasks.common; there are no import cycles between modules nor between tasks
subpackages; tasks/ holds only __init__.py, the stage modules and subpackages.

The checker below is a set of pure functions from a repository root to human-readable violations, so the
same code runs on the real tree and on small planted trees under tmp_path.
"""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("contract", "models", "expectations", "tasks", "flows")
STAGES = (
    "tasks.target",
    "tasks.ingest",
    "tasks.regenerate",
    "tasks.validate",
    "tasks.capture",
    "tasks.train",
    "tasks.evaluate",
    "tasks.benchmark",
    "tasks.register",
)
COMMON = "tasks.common"
COMMON_MAY_IMPORT = ("contract", "models", COMMON)

REPO_ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# Reading the tree
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Edge:
    """One import statement that names a project module: where it is and what it imports."""

    source: str  # dotted name of the importing module
    path: str  # importing file, relative to the root, with forward slashes
    line: int
    target: str  # dotted name of the imported project module

    def where(self) -> str:
        """Location and target, the common prefix of every message about this import."""
        return f"{self.path}:{self.line} imports {self.target}"


def module_name(root: Path, file: Path) -> str:
    """Dotted module name of a file: tasks/data/journal.py -> tasks.data.journal, tasks/data/__init__.py -> tasks.data."""
    parts = list(file.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files(root: Path) -> dict[str, Path]:
    """Every checked module (by dotted name) and its file, skipping caches."""
    files: dict[str, Path] = {}
    for package in PACKAGES:
        top = root / package
        if not top.is_dir():
            continue
        for file in sorted(top.rglob("*.py")):
            if "__pycache__" in file.relative_to(root).parts:
                continue
            files[module_name(root, file)] = file
    return files


def known_modules(files: dict[str, Path]) -> set[str]:
    """Module names importable in the tree: every file plus every package directory above one."""
    names: set[str] = set()
    for name in files:
        parts = name.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return names


def in_checked_packages(name: str) -> bool:
    """Whether a dotted name belongs to one of the five checked packages (others, stdlib or torch, are ignored)."""
    return name.split(".")[0] in PACKAGES


def importing_package(name: str, file: Path) -> list[str]:
    """Package against which a relative import in this module resolves (the module itself for an __init__)."""
    parts = name.split(".")
    return parts if file.name == "__init__.py" else parts[:-1]


def resolve_from(node: ast.ImportFrom, name: str, file: Path, known: set[str]) -> list[str]:
    """Modules named by `from X import Y`: X.Y where that is a module or package, otherwise X."""
    if node.level:
        package = importing_package(name, file)
        keep = len(package) - (node.level - 1)
        if keep <= 0:
            return []  # relative import above the top-level package: not a project module
        base = ".".join(package[:keep] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if not in_checked_packages(base):
        return []
    targets = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        targets.append(submodule if alias.name != "*" and submodule in known else base)
    return targets


def file_edges(root: Path, name: str, file: Path, known: set[str]) -> list[Edge]:
    """Every project import in one file, at any depth (functions, TYPE_CHECKING blocks, try/except)."""
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    path = file.relative_to(root).as_posix()
    edges: list[Edge] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names if in_checked_packages(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            targets = resolve_from(node, name, file, known)
        else:
            continue
        edges.extend(Edge(name, path, node.lineno, target) for target in targets)
    return sorted(set(edges), key=lambda e: (e.path, e.line, e.target))


def read_edges(root: Path) -> tuple[dict[str, Path], list[Edge], list[str]]:
    """All checked modules, all their project imports, and a violation for any file that does not parse."""
    files = source_files(root)
    known = known_modules(files)
    edges: list[Edge] = []
    problems: list[str] = []
    for name, file in files.items():
        try:
            edges.extend(file_edges(root, name, file, known))
        except SyntaxError as error:
            problems.append(f"{file.relative_to(root).as_posix()}:{error.lineno}: cannot parse: {error.msg}")
    return files, edges, problems


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------


def tasks_subpackages(root: Path) -> set[str]:
    """Dotted names of the directories directly under tasks/ (each one is a rank-2 subpackage)."""
    tasks = root / "tasks"
    if not tasks.is_dir():
        return set()
    return {f"tasks.{d.name}" for d in tasks.iterdir() if d.is_dir() and is_source_dir(d)}


def is_source_dir(directory: Path) -> bool:
    """Whether a directory holds code of ours (not a cache or hidden folder)."""
    return directory.name != "__pycache__" and not directory.name.startswith(".")


def subpackage_of(name: str, subpackages: set[str]) -> str | None:
    """The tasks subpackage (tasks.<sub>) a module lives in, or None outside the subpackages."""
    parts = name.split(".")
    if parts[0] != "tasks" or len(parts) < 2:
        return None
    top = ".".join(parts[:2])
    return top if len(parts) > 2 or top in subpackages else None


def layer(name: str, subpackages: set[str]) -> tuple[int, str]:
    """Rank and human name of the layer a module belongs to."""
    top = name.split(".")[0]
    if top == "contract":
        return 0, "contract"
    if top == "models":
        return 1, "models"
    if top == "expectations":
        return 2, "expectations"
    if top == "flows":
        return 4, "flows"
    if name in STAGES:
        return 3, "stages"
    if name == "tasks":
        return 3, "the tasks package"
    if subpackage_of(name, subpackages):
        return 2, "tasks subpackages"
    # A loose helper at tasks/ top level (reported on its own as stray): it belongs in a subpackage, so
    # its imports are held to the rank it will have there.
    return 2, "stray tasks modules"


def within(name: str, package: str) -> bool:
    """Whether a module is the package itself or lives under it."""
    return name == package or name.startswith(package + ".")


def edge_violation(edge: Edge, subpackages: set[str]) -> str | None:
    """Why one import breaks the layering, or None when it is allowed."""
    source_rank, source_layer = layer(edge.source, subpackages)
    target_rank, target_layer = layer(edge.target, subpackages)
    if target_rank > source_rank:
        return (
            f"{edge.where()}: {source_layer} (rank {source_rank}) may not import "
            f"{target_layer} (rank {target_rank})"
        )
    if edge.source in STAGES and edge.target in STAGES and edge.source != edge.target:
        return f"{edge.where()}: a stage never imports another stage"
    if within(edge.source, COMMON) and not any(within(edge.target, p) for p in COMMON_MAY_IMPORT):
        return f"{edge.where()}: tasks.common may only import contract, models and tasks.common"
    return None


def layer_violations(edges: list[Edge], subpackages: set[str]) -> list[str]:
    """Every import that reaches up a layer, across stages, or out of tasks.common."""
    found = (edge_violation(edge, subpackages) for edge in edges)
    return [message for message in found if message]


# --------------------------------------------------------------------------------------------------
# Cycles
# --------------------------------------------------------------------------------------------------


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of a directed graph (each sorted, all in sorted order)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def shortest_cycle(graph: dict[str, set[str]], start: str, members: set[str]) -> list[str]:
    """A shortest path start -> ... -> start inside one component, to name a concrete cycle."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph.get(node, ()) & members):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return list(reversed(path)) + [start]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    return [start]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle per component of more than one node, or per node that imports itself."""
    found = []
    for component in strongly_connected(graph):
        if len(component) > 1 or component[0] in graph.get(component[0], set()):
            found.append(shortest_cycle(graph, component[0], set(component)))
    return found


def describe_cycle(cycle: list[str], component: list[str]) -> str:
    """A cycle as `cycle: a -> b -> a`, naming any other modules tangled in the same component."""
    others = [name for name in component if name not in cycle]
    tangled = f" (also tangled in it: {', '.join(others)})" if others else ""
    return f"cycle: {' -> '.join(cycle)}{tangled}"


def module_cycle_violations(files: dict[str, Path], edges: list[Edge]) -> list[str]:
    """Import cycles between modules: each one makes import order matter and blocks the layering."""
    graph: dict[str, set[str]] = {name: set() for name in files}
    for edge in edges:
        if edge.target in files:
            graph[edge.source].add(edge.target)
    components = {component[0]: component for component in strongly_connected(graph)}
    return [describe_cycle(cycle, components[cycle[0]]) for cycle in cycles(graph)]


def subpackage_cycle_violations(edges: list[Edge], subpackages: set[str]) -> list[str]:
    """Cycles between tasks subpackages: a subpackage must be movable without dragging its importers along."""
    graph: dict[str, set[str]] = {}
    witness: dict[tuple[str, str], Edge] = {}
    for edge in edges:
        source = subpackage_of(edge.source, subpackages)
        target = subpackage_of(edge.target, subpackages)
        if source and target and source != target:
            graph.setdefault(source, set()).add(target)
            witness.setdefault((source, target), edge)
    messages = []
    for cycle in cycles(graph):
        evidence = "; ".join(witness[(a, b)].where() for a, b in zip(cycle, cycle[1:]))
        messages.append(f"subpackage cycle: {' -> '.join(cycle)} ({evidence})")
    return messages


# --------------------------------------------------------------------------------------------------
# tasks/ top level
# --------------------------------------------------------------------------------------------------


def tasks_top_level_violations(root: Path) -> list[str]:
    """tasks/ holds only __init__.py, the nine stages and subpackages, so helpers cannot pile up beside stages."""
    tasks = root / "tasks"
    if not tasks.is_dir():
        return ["tasks/: missing"]
    allowed = {"__init__.py"} | {stage.split(".")[1] + ".py" for stage in STAGES}
    messages = []
    for entry in sorted(tasks.iterdir()):
        if entry.is_file() and entry.suffix == ".py" and entry.name not in allowed:
            messages.append(
                f"tasks/{entry.name}: stray module at tasks/ top level "
                "(only __init__.py, the stage modules and subpackages belong there)"
            )
        elif entry.is_dir() and is_source_dir(entry) and not (entry / "__init__.py").is_file():
            messages.append(f"tasks/{entry.name}/: subpackage without __init__.py")
    for expected in sorted(allowed):
        if not (tasks / expected).is_file():
            messages.append(f"tasks/{expected}: missing")
    return messages


# --------------------------------------------------------------------------------------------------
# The whole check
# --------------------------------------------------------------------------------------------------


def layout_violations(root: Path) -> list[str]:
    """Every layout rule the tree under root breaks, as messages naming the file and the imported module."""
    files, edges, problems = read_edges(root)
    subpackages = tasks_subpackages(root)
    return (
        problems
        + tasks_top_level_violations(root)
        + layer_violations(edges, subpackages)
        + module_cycle_violations(files, edges)
        + subpackage_cycle_violations(edges, subpackages)
    )


def report(violations: list[str]) -> str:
    """Violations one per line, for assertion messages."""
    return f"{len(violations)} layout violation(s):\n" + "\n".join(violations)


# --------------------------------------------------------------------------------------------------
# The real tree
# --------------------------------------------------------------------------------------------------


def test_repository_layout_holds() -> None:
    """The real repository obeys every layering rule."""
    violations = layout_violations(REPO_ROOT)
    assert not violations, report(violations)


# --------------------------------------------------------------------------------------------------
# Planted trees
# --------------------------------------------------------------------------------------------------

# Every import points down or sideways as allowed, and each module a planted test imports "upward" imports
# nothing that leads back, so each planted violation is the only one reported.
STAGE_FILES = {f"tasks/{stage.split('.')[1]}.py": "from tasks.common.y import z\n" for stage in STAGES}
CLEAN_TREE: dict[str, str] = {
    "contract/__init__.py": "",
    "contract/records.py": "RECORD = 1\n",
    "models/__init__.py": "",
    "models/x.py": "from contract.records import RECORD\n",
    "expectations/__init__.py": "",
    "expectations/checks.py": "from models import x\nfrom tasks.data.journal import write\n",
    "tasks/__init__.py": "",
    "tasks/common/__init__.py": "",
    "tasks/common/y.py": "from contract import records\n\nz = records.RECORD\n",
    "tasks/common/devices.py": "from models.x import RECORD\nfrom .y import z\nfrom . import y\n",
    "tasks/data/__init__.py": "from .journal import write\n",
    "tasks/data/journal.py": "def write():\n    return None\n",
    "tasks/data/split.py": "import tasks.data.journal\nfrom contract.records import RECORD\n",
    "tasks/features/__init__.py": "",
    "tasks/features/batches.py": (
        "from typing import TYPE_CHECKING\n\n"
        "from tasks.data import journal\nfrom ..common import devices\n\n"
        "if TYPE_CHECKING:\n    from expectations.checks import x\n"
    ),
    **STAGE_FILES,
    "tasks/ingest.py": "from tasks.data import write\nfrom tasks.common.y import z\n",
    "tasks/capture.py": "from tasks.features.batches import journal\n",
    "flows/__init__.py": "",
    "flows/version.py": "VERSION = '0'\n",
    "flows/cli.py": (
        "from flows.deployments import deploy\nfrom flows.version import VERSION\n"
        "from tasks import train\nimport tasks.capture\n"
    ),
    "flows/deployments.py": "from tasks.features.batches import journal\n\ndef deploy():\n    from tasks.evaluate import z\n",
}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """Write a small fake repository (path -> source) under root."""
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def planted(root: Path, changes: dict[str, str]) -> list[str]:
    """Violations of the clean fake tree with some files replaced or added."""
    return layout_violations(write_tree(root, {**CLEAN_TREE, **changes}))


def test_clean_fake_tree_has_no_violations(tmp_path: Path) -> None:
    """Downward, same-layer, relative and TYPE_CHECKING imports that follow the rules are all accepted."""
    assert layout_violations(write_tree(tmp_path, CLEAN_TREE)) == []


def test_upward_import_at_module_level_is_reported(tmp_path: Path) -> None:
    """A model reaching up into the tasks subpackages is named with its file, line and target."""
    violations = planted(tmp_path, {"models/x.py": "from tasks.common.y import z\n"})
    assert violations == [
        "models/x.py:1 imports tasks.common.y: models (rank 1) may not import tasks subpackages (rank 2)"
    ]


def test_upward_import_inside_function_is_reported(tmp_path: Path) -> None:
    """Deferring an upward import into a function body does not hide it."""
    source = "from contract.records import RECORD\n\n\ndef load():\n    from tasks.common.y import z\n    return z\n"
    violations = planted(tmp_path, {"models/x.py": source})
    assert violations == [
        "models/x.py:5 imports tasks.common.y: models (rank 1) may not import tasks subpackages (rank 2)"
    ]


def test_upward_import_under_type_checking_is_reported(tmp_path: Path) -> None:
    """An import only for type hints still couples the layers, so it counts."""
    source = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from flows.version import VERSION\n"
    violations = planted(tmp_path, {"contract/records.py": source})
    assert violations == [
        "contract/records.py:4 imports flows.version: contract (rank 0) may not import flows (rank 4)"
    ]


def test_stage_importing_another_stage_is_reported(tmp_path: Path) -> None:
    """Stages share code through subpackages, never through each other, in every import spelling."""
    spellings = [
        "import tasks.capture",
        "from tasks import capture",
        "from tasks.capture import run",
        "from . import capture",
        "from .capture import run",
    ]
    source = "\n".join(spellings) + "\n"
    violations = planted(tmp_path, {"tasks/evaluate.py": source})
    assert violations == [
        f"tasks/evaluate.py:{line} imports tasks.capture: a stage never imports another stage"
        for line in range(1, len(spellings) + 1)
    ]


def test_subpackage_importing_a_stage_is_reported(tmp_path: Path) -> None:
    """Subpackages sit below the stages, absolute or relative import alike."""
    source = "from tasks.train import run\nfrom ..train import run as again\n"
    violations = planted(tmp_path, {"tasks/data/journal.py": source})
    assert violations == [
        f"tasks/data/journal.py:{line} imports tasks.train: tasks subpackages (rank 2) may not import stages (rank 3)"
        for line in (1, 2)
    ]


def test_common_importing_another_subpackage_is_reported(tmp_path: Path) -> None:
    """tasks.common is the bottom plumbing and may not lean on tasks.data."""
    source = "from contract import records\nfrom tasks.data.journal import write\n\nz = records.RECORD\n"
    violations = planted(tmp_path, {"tasks/common/y.py": source})
    assert violations == [
        "tasks/common/y.py:2 imports tasks.data.journal: tasks.common may only import contract, models and tasks.common"
    ]


def test_module_cycle_is_reported(tmp_path: Path) -> None:
    """Two flows modules importing each other form a cycle even when one import is deferred into a function."""
    source = "def deploy():\n    from flows import cli\n    return cli\n"
    violations = planted(tmp_path, {"flows/deployments.py": source})
    assert violations == ["cycle: flows.cli -> flows.deployments -> flows.cli"]


def test_self_import_is_reported(tmp_path: Path) -> None:
    """A module importing itself is a cycle of one."""
    violations = planted(tmp_path, {"flows/deployments.py": "import flows.deployments\n\ndef deploy():\n    pass\n"})
    assert violations == ["cycle: flows.deployments -> flows.deployments"]


def test_subpackage_cycle_is_reported(tmp_path: Path) -> None:
    """tasks.data and tasks.features importing each other through different modules is a package-level cycle."""
    changes = {
        "tasks/data/journal.py": "from tasks.features.batches import devices\n\ndef write():\n    return None\n",
        "tasks/features/online.py": "from tasks.data.split import RECORD\n",
        "tasks/features/batches.py": "from ..common import devices\n",
    }
    violations = planted(tmp_path, changes)
    assert violations == [
        "subpackage cycle: tasks.data -> tasks.features -> tasks.data "
        "(tasks/data/journal.py:1 imports tasks.features.batches; tasks/features/online.py:1 imports tasks.data.split)"
    ]


def test_stray_module_at_tasks_top_level_is_reported(tmp_path: Path) -> None:
    """A helper beside the stages must move into a subpackage, even if nothing imports it."""
    violations = planted(tmp_path, {"tasks/helpers.py": "from tasks.common.y import z\n"})
    assert violations == [
        "tasks/helpers.py: stray module at tasks/ top level "
        "(only __init__.py, the stage modules and subpackages belong there)"
    ]


def test_subpackage_without_init_is_reported(tmp_path: Path) -> None:
    """Every directory under tasks/ is a real package."""
    write_tree(tmp_path, CLEAN_TREE)
    (tmp_path / "tasks/features/__init__.py").unlink()
    assert layout_violations(tmp_path) == ["tasks/features/: subpackage without __init__.py"]


# --------------------------------------------------------------------------------------------------
# A planted violation in a copy of the real tree
# --------------------------------------------------------------------------------------------------


def copy_real_packages(destination: Path) -> Path:
    """Copy the five checked packages of the real repository, without caches."""
    for package in PACKAGES:
        shutil.copytree(REPO_ROOT / package, destination / package, ignore=shutil.ignore_patterns("__pycache__"))
    return destination


def test_planted_upward_import_in_real_tree_is_reported(tmp_path: Path) -> None:
    """Adding one deferred upward import to the real models/eagle3.py adds exactly that violation."""
    root = copy_real_packages(tmp_path)
    before = layout_violations(root)
    eagle3 = root / "models/eagle3.py"
    text = eagle3.read_text(encoding="utf-8")
    text += "" if text.endswith("\n") else "\n"
    line = len(text.splitlines()) + 4
    eagle3.write_text(text + "\n\ndef _planted():\n    from flows.cli import app\n    return app\n", encoding="utf-8")

    after = layout_violations(root)

    added = [v for v in after if v not in before]
    removed = [v for v in before if v not in after]
    expected = f"models/eagle3.py:{line} imports flows.cli: models (rank 1) may not import flows (rank 4)"
    assert [v for v in added if not v.startswith("cycle: ")] == [expected], report(added)
    # flows.cli reaches models.eagle3 through the stages, so the planted edge also closes an import cycle
    # (or merges existing ones); only cycle messages may change, and each changed one holds the planted edge.
    assert all(v.startswith("cycle: ") for v in removed), report(removed)
    for message in (v for v in added if v.startswith("cycle: ")):
        assert "models.eagle3" in message and "flows.cli" in message, report(added)
