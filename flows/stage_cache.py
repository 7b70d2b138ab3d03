"""What decides whether a stage must run again, read from dvc.yaml so that Prefect and DVC agree.

A stage's cache key hashes its inputs by content: the upstream artifacts its dvc.yaml `deps` list
(`${output_dir}` resolved from the run config, files and directories) and the code it runs, derived from its
imports by tasks/common/stage_code.py (the same list `eaglet dvc sync` writes into dvc.yaml's deps); the config fields it
declares in flows/stages.py `STAGE_READS` (values from the resolved RunConfig; dvc.yaml's `params` list the same
names) and, for ingest, the files `data.sources` names; from outside the repository, the package versions of the
engines the stage runs and the identity of the regeneration server (flows/outside_inputs.py). A cached result
is only reused while the stage's outputs (`outs`, `metrics`, `plots`) are still the ones it wrote:
`record_outputs` stamps them after each run and `outputs_unchanged` compares (a missing file fails it).

Hashing reads every byte once; a memo keyed by (size, mtime, inode), like DVC's state database, keeps
large unchanged files (target weights, feature shards) from being read again on every run.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from contract.config import RunConfig
from contract.hashing import hash_file, hash_text
from tasks.common.stage_code import stage_code_deps
from flows.outside_inputs import outside_inputs
from flows.stages import stage_reads
from tasks.common.artifacts import read_json, write_json
from tasks.data.sources import source_fingerprints

REPO_ROOT = Path(__file__).resolve().parent.parent
DVC_FILE = REPO_ROOT / "dvc.yaml"
OUTPUT_DIR_VARIABLE = "${output_dir}"
RESULTS_DIR = ".prefect-results"
OUTPUT_SECTIONS = ("outs", "metrics", "plots")
IGNORED_NAMES = {"__pycache__", ".ipynb_checkpoints"}
MISSING = "missing"


@dataclass(frozen=True)
class StageSpec:
    """One dvc.yaml stage: the paths it reads, the config sections it uses, the paths it writes."""

    name: str
    deps: tuple[str, ...]
    params: tuple[str, ...]
    outputs: tuple[str, ...]


@lru_cache(maxsize=4)
def read_dvc_stages(dvc_file: Path = DVC_FILE) -> dict[str, StageSpec]:
    """Every stage of dvc.yaml (read once per process)."""
    stages = yaml.safe_load(dvc_file.read_text(encoding="utf-8"))["stages"]
    return {name: parse_stage(name, body) for name, body in stages.items()}


def parse_stage(name: str, body: dict[str, Any]) -> StageSpec:
    outputs: list[str] = []
    for section in OUTPUT_SECTIONS:
        outputs += entry_names(body.get(section, []))
    return StageSpec(name, tuple(entry_names(body.get("deps", []))), tuple(param_names(body.get("params", []))),
                     tuple(outputs))


def entry_names(entries: Iterable[Any]) -> list[str]:
    """Paths of dvc.yaml entries, written either as `path` or as `{path: {options}}`."""
    names: list[str] = []
    for entry in entries:
        names += [entry] if isinstance(entry, str) else list(entry)
    return names


def param_names(entries: Iterable[Any]) -> list[str]:
    """Dotted param names; `{params_file: [names]}` entries contribute their names."""
    names: list[str] = []
    for entry in entries:
        if isinstance(entry, str):
            names.append(entry)
        else:
            for listed in entry.values():
                names += list(listed)
    return names


def stage_spec(name: str) -> StageSpec:
    """The dvc.yaml description of stage `name`; a stage missing there is a wiring error, said plainly."""
    stages = read_dvc_stages()
    if name not in stages:
        raise KeyError(f"stage '{name}' is not described in {DVC_FILE}; add its deps/params/outs there")
    return stages[name]


def resolve_path(entry: str, cfg: RunConfig) -> Path:
    """A dvc.yaml path: `${output_dir}` is the run's output dir, other relative paths hang off the repo root."""
    if entry.startswith(OUTPUT_DIR_VARIABLE):
        relative = entry[len(OUTPUT_DIR_VARIABLE):].lstrip("/")
        return cfg.output_path.resolve() / relative
    path = Path(entry)
    return path if path.is_absolute() else REPO_ROOT / path


def param_value(cfg: RunConfig, dotted: str) -> Any:
    """The resolved config value at `section.field` (defaults filled in, overrides applied)."""
    node: Any = cfg.model_dump(mode="json")
    for part in dotted.split("."):
        node = node[part]
    return node


def results_dir(cfg: RunConfig) -> Path:
    """Where Prefect persists stage results and this module keeps its memo and stamps."""
    return cfg.output_path.resolve() / RESULTS_DIR


class HashMemo:
    """sha256 per file, remembered by (size, mtime_ns, inode) in a JSON file beside the results."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, list[Any]] = read_json(path) if path.is_file() else {}
        self.changed = False

    def file_digest(self, path: Path) -> str:
        info = path.stat()
        signature = [info.st_size, info.st_mtime_ns, info.st_ino]
        known = self.entries.get(str(path))
        if known is not None and known[:3] == signature:
            return known[3]
        digest = hash_file(path)
        self.entries[str(path)] = [*signature, digest]
        self.changed = True
        return digest

    def path_digest(self, path: Path) -> str:
        """A file's hash, a directory's hash over (relative name, file hash), or 'missing'."""
        if path.is_file():
            return self.file_digest(path)
        if not path.is_dir():
            return MISSING
        digest = hashlib.sha256()
        for file in directory_files(path):
            digest.update(f"{file.relative_to(path).as_posix()}\0{self.file_digest(file)}\0".encode())
        return digest.hexdigest()

    def save(self) -> None:
        if self.changed:
            write_json(self.path, self.entries)
            self.changed = False


def directory_files(directory: Path) -> list[Path]:
    """Files under `directory` in a stable order, without Python's bytecode caches."""
    files = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(name for name in dirs if name not in IGNORED_NAMES)
        files += [Path(root) / name for name in sorted(names) if not name.endswith(".pyc")]
    return files


def open_memo(cfg: RunConfig) -> HashMemo:
    return HashMemo(results_dir(cfg) / "hash-memo.json")


def digests(entries: Iterable[str], cfg: RunConfig, memo: HashMemo) -> dict[str, str]:
    """Content hash per dvc.yaml entry, keyed by the entry as written (so moving output_dir changes nothing)."""
    return {entry: memo.path_digest(resolve_path(entry, cfg)) for entry in entries}


def data_deps(name: str) -> tuple[str, ...]:
    """The upstream artifacts stage `name` reads: its dvc.yaml deps under `${output_dir}`."""
    return tuple(dep for dep in stage_spec(name).deps if dep.startswith(OUTPUT_DIR_VARIABLE))


def stage_cache_key(name: str, cfg: RunConfig) -> str:
    """The hash of everything stage `name` reads: its upstream artifacts and its code (tasks/common/stage_code.py) by
    content, its declared config fields (flows/stages.py STAGE_READS, which dvc.yaml's params mirror) by value,
    for ingest the source files, and the versions of the engines it runs and the model the regeneration server
    serves (flows/outside_inputs.py)."""
    reads = stage_reads(name)
    memo = open_memo(cfg)
    inputs: dict[str, Any] = {
        "stage": name,
        "deps": digests([*data_deps(name), *stage_code_deps(name)], cfg, memo),
        "params": {param: param_value(cfg, param) for param in reads.params},
    }
    if reads.source_files:
        inputs["source_files"] = source_fingerprints(cfg, memo.file_digest)
    inputs.update(outside_inputs(name, cfg, results_dir(cfg)))
    memo.save()
    return hash_text(json.dumps(inputs, sort_keys=True))


def outputs_fingerprint(name: str, cfg: RunConfig) -> Optional[dict[str, str]]:
    """Content hash per output of stage `name`, or None when any of them is missing."""
    memo = open_memo(cfg)
    fingerprint = digests(stage_spec(name).outputs, cfg, memo)
    memo.save()
    if MISSING in fingerprint.values():
        return None
    return fingerprint


def stamp_path(name: str, cfg: RunConfig) -> Path:
    return results_dir(cfg) / "outputs" / f"{name}.json"


def record_outputs(name: str, cfg: RunConfig) -> None:
    """Remember the outputs stage `name` just wrote (or reused), for `outputs_unchanged` on the next run."""
    write_json(stamp_path(name, cfg), outputs_fingerprint(name, cfg))


def outputs_unchanged(name: str, cfg: RunConfig) -> bool:
    """True when every output of the stage exists and holds what the last run left there."""
    stamp = stamp_path(name, cfg)
    if not stamp.is_file():
        return False
    current = outputs_fingerprint(name, cfg)
    return current is not None and current == read_json(stamp)
