"""What a stage's result depends on outside the config, the repository and output_dir: the engines it runs and the
regeneration server it asks. Both join the stage's cache key (flows/stage_cache.py).

- The package versions the python of each engine a stage starts reports (tasks/serving/engine_versions.py):
  regenerate with `regeneration.engine`, capture with `capture.backend: vllm` (online training too), benchmark
  with `benchmark.engines`. An upgraded engine environment reruns them.
- For regenerate at `regeneration.base_url`: the served model's identity (tasks/data/served_model.py), asked of
  the endpoints when the key is computed, so another model behind the same URL reruns the stage. When no endpoint
  answers (the server stopped once regeneration was done, e.g. to free its GPU for the benchmark), the identity
  last seen at that URL stands in, so a finished stage is still reused; the stage itself refuses to run without
  a server that serves the run's target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from contract.config import RunConfig
from contract.secrets import SecretUnavailable
from tasks.common.artifacts import read_json, write_json
from tasks.data.served_model import served_identity_or_none
from tasks.data.server_access import ServerAccess, server_access
from tasks.serving.engine_versions import engine_versions

#: How long the key waits for a regeneration endpoint's /models (a stopped server refuses at once).
SERVER_PROBE_TIMEOUT_S = 5.0


def stage_engines(name: str, cfg: RunConfig) -> list[str]:
    """The engines stage `name` starts with this config."""
    regeneration = cfg.regeneration
    if name == "regenerate":
        started = regeneration.enabled and regeneration.backend == "openai" and not regeneration.base_url
        return [regeneration.engine] if started and regeneration.engine else []
    if name == "capture" or (name == "train" and cfg.training.mode == "online"):
        return ["vllm"] if cfg.capture.backend == "vllm" else []
    if name == "benchmark":
        return list(cfg.benchmark.engines)
    return []


def regeneration_accesses(cfg: RunConfig) -> list[ServerAccess]:
    """The regeneration endpoints, when regenerate asks a server at base_url; none when a secret is unavailable
    (the stage names it when it runs)."""
    regeneration = cfg.regeneration
    if not (regeneration.enabled and regeneration.backend == "openai" and regeneration.base_url):
        return []
    try:
        return [server_access(url, regeneration) for url in regeneration.endpoints]
    except SecretUnavailable:
        return []


def server_identity(accesses: list[ServerAccess], seen_path: Path) -> Optional[dict[str, Any]]:
    """The identity the endpoints serve now (remembered per URL), else the one last seen at the first of them
    that has one, else None."""
    seen: dict[str, Any] = read_json(seen_path) if seen_path.is_file() else {}
    identity = served_identity_or_none(accesses, SERVER_PROBE_TIMEOUT_S)
    if identity is None:
        return next((seen[access.base_url] for access in accesses if access.base_url in seen), None)
    if any(seen.get(access.base_url) != identity for access in accesses):
        write_json(seen_path, {**seen, **{access.base_url: identity for access in accesses}})
    return identity


def outside_inputs(name: str, cfg: RunConfig, results: Path) -> dict[str, Any]:
    """The key's part from outside (empty for a stage that runs no engine and asks no server); `results` holds
    the memos."""
    inputs: dict[str, Any] = {}
    engines = {kind: engine_versions(kind, cfg.runtime.engines[kind], results / "engine-versions.json")
               for kind in stage_engines(name, cfg)}
    if engines:
        inputs["engine_versions"] = engines
    accesses = regeneration_accesses(cfg) if name == "regenerate" else []
    if accesses:
        inputs["served_model"] = server_identity(accesses, results / "served-models.json")
    return inputs
