"""The package versions an engine's own python reports (vllm, sglang, torch, transformers), for stage cache keys.

A stage that runs an engine depends on the engine's environment as much as on its config: upgrading
`.venv-sglang` must not reuse a benchmark measured with the old SGLang. The versions are read by running the
engine's interpreter, with the environment the engine gets (its `runtime.engines.<kind>.env`, e.g. a PYTHONPATH),
on `importlib.metadata` (no package is imported, so it takes a fraction of a second). The answer is remembered in
a JSON memo beside the stage results, by interpreter and PYTHONPATH, and stays valid while the interpreter file and
every directory of its `sys.path` keep their mtimes: installing, upgrading or removing a package adds or renames a
`*.dist-info` directory, which changes its site directory's mtime, so a key stays cheap and still notices.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Optional

from contract.config import EngineConfig
from contract.secrets import SecretUnavailable
from tasks.common.artifacts import read_json, write_json
from tasks.serving.engine import EngineLaunch, engine_environment, resolve_python

#: The distributions whose versions key an engine's stages.
PACKAGES = ("vllm", "sglang", "torch", "transformers")
PROBE_TIMEOUT_S = 120.0

#: Run by the engine's python: the versions of PACKAGES (None where one is not installed) and its sys.path dirs.
PROBE = """
import importlib.metadata, json, os, sys
versions = {"python": sys.version.split()[0]}
for name in sys.argv[1:]:
    try:
        versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        versions[name] = None
print(json.dumps({"versions": versions, "path": [entry for entry in sys.path if entry and os.path.isdir(entry)]}))
"""


def probe_environment(kind: str, engine: EngineConfig) -> dict[str, str]:
    """The environment the engine would start with (tasks/serving/engine.py `engine_environment`); a redacted
    config's env values are left out (they cannot be read back), so the probe sees at least our own environment."""
    try:
        launch = EngineLaunch.from_config(kind, engine, model=Path(), log_path=Path())
    except SecretUnavailable:
        launch = EngineLaunch(kind=kind, model=Path(), python=engine.python, port=engine.port, log_path=Path())
    return engine_environment(launch, os.environ)


def memo_key(python: str, environment: dict[str, str]) -> str:
    """The memo's key of one interpreter under one PYTHONPATH (hashed: env values are secrets by contract)."""
    return hashlib.sha256(f"{python}\0{environment.get('PYTHONPATH', '')}".encode()).hexdigest()


def stat_signature(path: str) -> Optional[list[int]]:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return [info.st_size, info.st_mtime_ns, info.st_ino]


def still_valid(entry: dict[str, Any], python: str) -> bool:
    """The interpreter and every directory of its sys.path are as they were when it was probed."""
    if entry.get("python") != stat_signature(python):
        return False
    return all(stat_signature(directory) == signature for directory, signature in entry.get("dirs", {}).items())


def probe(python: str, environment: dict[str, str]) -> Optional[dict[str, Any]]:
    """The probe's answer from `python`, or None when it failed (an interpreter that cannot even start)."""
    try:
        finished = subprocess.run([python, "-c", PROBE, *PACKAGES], env=environment, capture_output=True,
                                  text=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if finished.returncode != 0:
        return None
    try:
        return json.loads(finished.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def engine_versions(kind: str, engine: EngineConfig, memo_path: Path) -> dict[str, Any]:
    """What `runtime.engines.<kind>.python` reports of PACKAGES, from the memo while it is still valid."""
    python = resolve_python(engine.python)
    if python is None:
        return {"python": f"missing: {engine.python}"}
    environment = probe_environment(kind, engine)
    key = memo_key(python, environment)
    memo: dict[str, Any] = read_json(memo_path) if memo_path.is_file() else {}
    entry = memo.get(key)
    if isinstance(entry, dict) and still_valid(entry, python):
        return entry["versions"]
    answer = probe(python, environment)
    if answer is None:
        return {"python": f"probe failed: {python}"}
    memo[key] = {"python": stat_signature(python), "versions": answer["versions"],
                 "dirs": {directory: stat_signature(directory) for directory in answer["path"]}}
    write_json(memo_path, memo)
    return answer["versions"]
