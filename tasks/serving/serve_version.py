"""`eaglet serve`: from a registered drafter version to the engine launch that serves it with the run's target.

The registry holds everything a serving command needs (the export per engine, its contract, the setting the
benchmark measured fastest in the `eaglet.recommended_serving` tag); assembling the vLLM or SGLang command line by
hand from them is where a wrong export, a stale chain length or another target slips in. This module resolves the
version, downloads its export for the engine, refuses it when its contract names another target than the one it
would serve, reads the recommended setting (falling back to `evaluation.steps` where the tag is missing) and builds
the launch with the benchmark's own builder (tasks/serving/engine_settings.py: the same dtype, eager or CUDA graphs
and GPUs), so what is served is what was measured.
flows/cli.py `serve` is only the glue: it prints `launch_text` (--print) or runs `serve_in_foreground`.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from contract.checkpoint import CheckpointContract, ContractMismatch, check_against_target
from contract.config import RunConfig
from tasks.serving.engine import (DEFAULT_ENV, GPU_VARIABLE, EngineKind, EngineLaunch, RunningEngine, engine_command,
                                  resolve_python, serve)
from tasks.serving.engine_settings import run_launch
from tasks.serving.serving_setting import ServingSetting, engines_serving, unserved_method

#: Where the served versions' exports and engine logs go, under the run's output dir.
SERVE_DIR = "serve"


class ServeRefused(ValueError):
    """The version cannot be served here as asked (no such version, another target, a method the engine lacks)."""


@dataclass(frozen=True)
class ServedVersion:
    """One registered version, ready to serve: where its export lies, the setting it is served with, and why."""

    model_name: str
    version: int
    engine: EngineKind
    export: Path
    setting: ServingSetting
    #: Where the setting came from: the version's tag, or why the config's `evaluation.steps` chain stands in.
    setting_source: str
    launch: EngineLaunch


def resolve_version(client: Any, name: str, alias: Optional[str], version: Optional[int]) -> int:
    """The version number `--version` names (checked to exist) or the one holding `alias`."""
    from mlflow.exceptions import MlflowException

    where = client.tracking_uri
    if version is not None:
        try:
            client.get_model_version(name, str(version))
        except MlflowException:
            raise ServeRefused(f"no version {version} of '{name}' in {where}") from None
        return version
    from tasks.registry.store import alias_version

    held = alias_version(client, name, alias or "champion")
    if held is None:
        raise ServeRefused(f"no version of '{name}' has alias '{alias}' in {where} (eaglet registry show lists them)")
    return held


def recommended_setting(tag: Optional[str], engine: str, fallback_steps: int) -> tuple[ServingSetting, str]:
    """The setting the version's `eaglet.recommended_serving` tag recommends for `engine`, and where it came from.

    The tag (tasks/register.py `recommended_serving`) is JSON {engine: {num_speculative_tokens, steps, topk,
    num_draft_tokens, ...}}, or "not measured" when no benchmark ran; older versions have none. Without an entry
    for the engine the chain the offline evaluation measured (`evaluation.steps`) is served, and the source says so.
    """
    fallback = ServingSetting(fallback_steps)
    if tag is None:
        return fallback, f"the version has no eaglet.recommended_serving tag: evaluation.steps chain ({fallback_steps})"
    try:
        recommended = json.loads(tag)
    except ValueError:
        recommended = None
    entry = recommended.get(engine) if isinstance(recommended, dict) else None
    if not isinstance(entry, dict):
        why = f"'{tag}'" if not isinstance(recommended, dict) else f"no {engine} entry (measured: {', '.join(recommended)})"
        return fallback, f"eaglet.recommended_serving is {why}: evaluation.steps chain ({fallback_steps})"
    steps = entry.get("steps") or entry.get("num_speculative_tokens")
    if not steps:
        return fallback, f"eaglet.recommended_serving names no steps for {engine}: evaluation.steps chain ({fallback_steps})"
    setting = ServingSetting(int(steps), int(entry.get("topk") or 1), int(entry.get("num_draft_tokens") or 0))
    return setting, f"eaglet.recommended_serving ({engine}: {setting.label})"


def check_export(export: Path, engine: str, target_info: dict[str, Any]) -> CheckpointContract:
    """The export's contract, refused (ContractMismatch naming each field and both values) when it was trained for
    another target than the one it would be served with, or when the engine does not serve its method."""
    contract = CheckpointContract.model_validate_json((export / "contract.json").read_text(encoding="utf-8"))
    check_against_target(contract, target_info)
    reason = unserved_method(engine, contract.method)
    if reason is not None:
        raise ServeRefused(f"{export} is {reason}: serve it with --engine {engines_serving(contract.method)}")
    return contract


def served_version(cfg: RunConfig, engine: EngineKind, alias: Optional[str] = "champion",
                   version: Optional[int] = None, port: Optional[int] = None) -> ServedVersion:
    """Resolve, download and check the version; the launch that serves it with the run's `target/` (as the
    benchmark's drafted variant: same builder, runtime.engines.<engine> settings), on `port` when given."""
    from tasks.registry.doctor import resolve_target_info
    from tasks.registry.store import TAG_RECOMMENDED_SERVING, download_drafter, registry_client

    if engine not in cfg.runtime.engines:
        raise ServeRefused(f"runtime.engines does not configure {engine} (python of the engine's environment, port)")
    target = cfg.output_path / "target"
    if not target.is_dir():
        raise FileNotFoundError(f"serving needs the run's target {target}: run the target stage")
    target_info = resolve_target_info(target)
    name = cfg.registry.model_name
    client = registry_client(cfg)
    number = resolve_version(client, name, alias, version)
    tags = client.get_model_version(name, str(number)).tags
    export = download_drafter(cfg, name, None, engine, cfg.output_path / SERVE_DIR / f"v{number}", version=number)
    try:
        check_export(export, engine, target_info)
    except ContractMismatch as error:
        raise ContractMismatch(f"{name} v{number} was trained for another target than {target} "
                               f"(target.json beside it): {error}") from None
    setting, source = recommended_setting(tags.get(TAG_RECOMMENDED_SERVING), engine, cfg.evaluation.steps)
    launch = run_launch(cfg, engine, model=target,
                        log_path=cfg.output_path / SERVE_DIR / "logs" / f"{engine}-v{number}.log",
                        draft=export, num_speculative_tokens=setting.steps, topk=setting.topk,
                        num_draft_tokens=setting.num_draft_tokens)
    if port is not None:
        launch = dataclasses.replace(launch, port=port)
    return ServedVersion(name, number, engine, export, setting, source, launch)


def launch_text(launch: EngineLaunch, field: str) -> str:
    """The environment the engine gets on top of the caller's, then its command line, as shell text (--print).
    The values of `field` (runtime.engines.<engine>.env) are secrets by contract (contract/secrets.py): written
    as ***, never in the clear; the GPUs it is placed on (runtime.engines.<engine>.gpus) are not. The python is the
    one `start_engine` would run (resolved where it exists)."""
    defaults = {key: value for key, value in DEFAULT_ENV.get(launch.kind, {}).items() if key not in launch.env}
    lines = [f"export {key}={shlex.quote(value)}" for key, value in defaults.items()]
    lines += [f"export {key}=***  # {field}.{key} (secret)" for key in launch.env]
    if launch.gpus is not None:
        lines.append(f"export {GPU_VARIABLE}={shlex.quote(launch.gpus)}  # runtime.engines.{launch.kind}.gpus")
    python = resolve_python(launch.python) or launch.python
    lines.append(" ".join(shlex.quote(part) for part in engine_command(dataclasses.replace(launch, python=python))))
    return "\n".join(lines)


def serve_in_foreground(launch: EngineLaunch, on_ready: Callable[[RunningEngine], None],
                        poll_s: float = 1.0) -> int:
    """Start the engine, call `on_ready` once it answers, and keep it up until Ctrl-C (or SIGTERM turned into
    SystemExit by the caller) or until it exits by itself; always stop its process group. Returns its exit code
    when it ended by itself, 0 when interrupted."""
    with serve(launch) as engine:
        on_ready(engine)
        try:
            while engine.alive():
                time.sleep(poll_s)
        except KeyboardInterrupt:
            return 0
        return engine.process.returncode or 1
