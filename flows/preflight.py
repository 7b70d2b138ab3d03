"""Checks of a valid run config against this machine and its target, made before any stage runs.

contract/config.py rejects what no machine could run. These checks need the environment, so they run in
`eaglet config validate` and when a run is about to start (`eaglet run`, `eaglet stage`, `eaglet train`):
  - the target, once its config is on disk (`model.path` of a local target, else the target stage's
    `<output_dir>/target.json`): an architecture eaglet supports (models/target_families.py),
    capture.aux_layer_ids within its decoder layers and capture.draft_vocab_size within its vocabulary;
  - deployment.trainer.nproc_per_node within what torchrun can place here: one rank per visible GPU when the
    trainer runs on CUDA, one process per usable CPU core otherwise;
  - the python of every engine the run starts (regeneration.engine without a base_url, capture.backend vllm,
    benchmark.engines).
The whole config is checked whichever stage starts, so that `dvc repro` stops at its first stage instead of
at the benchmark hours later; `benchmark.engines=[]` runs the earlier stages where no engine is installed.
`eaglet config validate --schema-only` skips them all, so a cluster config can be checked on a laptop.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from contract.config import ModelConfig, RunConfig
from tasks.serving.engine import ENV_HINTS, resolve_python

TARGET_FIELDS = "the target's architecture, capture.aux_layer_ids, capture.draft_vocab_size"
#: What preflight checks, as `config validate --schema-only` names what it skipped.
HOST_CHECKS = (f"{TARGET_FIELDS} against the target; deployment.trainer.nproc_per_node against this host's CUDA "
               "devices or CPU cores; runtime.engines.<engine>.python of each engine the run starts")


@dataclass
class Preflight:
    """What stops the run on this machine (each naming its field), and what cannot be checked yet."""

    problems: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TargetDims:
    """What the checks read of the target, and the file it came from."""

    num_hidden_layers: int
    vocab_size: int
    origin: Path
    model_type: Optional[str] = None


def preflight(cfg: RunConfig) -> Preflight:
    """Every environment check of the config; nothing is started or written."""
    report = Preflight()
    dims, looked_at = target_dims(cfg)
    if dims is None:
        report.not_checked.append(f"{TARGET_FIELDS}: target not materialised (no {looked_at} for this model)")
    else:
        report.problems += target_problems(cfg, dims)
    report.problems += rank_problems(cfg)
    report.problems += engine_problems(cfg)
    return report


# --- the target -------------------------------------------------------------------------------------------


def target_dims(cfg: RunConfig) -> tuple[Optional[TargetDims], Path]:
    """The target's dims when they are on disk, and the file looked at: a local target's own config.json
    (what the target stage will copy), otherwise target.json of an earlier target stage for the same model."""
    if cfg.model.source == "local":
        path = Path(cfg.model.path or "").expanduser() / "config.json"
        return hf_config_dims(path), path
    path = cfg.output_path / "target.json"
    return materialised_dims(path, cfg.model), path


def hf_config_dims(path: Path) -> Optional[TargetDims]:
    """Dims from an HF config.json (a multimodal config nests its language model's under text_config)."""
    config = read_json_mapping(path)
    if config is None:
        return None
    return dims_of(config.get("text_config") or config, path)


def materialised_dims(path: Path, model: ModelConfig) -> Optional[TargetDims]:
    """Dims from target.json, unless it describes another model (the target stage has not run for this one)."""
    info = read_json_mapping(path)
    if info is None or (info.get("source"), info.get("id")) != (model.source, model.id):
        return None
    return dims_of(info, path)


def read_json_mapping(path: Path) -> Optional[dict[str, Any]]:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def dims_of(config: dict[str, Any], origin: Path) -> Optional[TargetDims]:
    layers, vocab = config.get("num_hidden_layers"), config.get("vocab_size")
    if not isinstance(layers, int) or not isinstance(vocab, int):
        return None
    model_type = config.get("model_type")
    return TargetDims(num_hidden_layers=layers, vocab_size=vocab, origin=origin,
                      model_type=model_type if isinstance(model_type, str) else None)


def target_problems(cfg: RunConfig, dims: TargetDims) -> list[str]:
    """A supported architecture; the aux layers (configured, or the defaults) within the target's layers; the
    draft vocab within its vocab."""
    from models.target_capture import resolve_aux_layer_ids  # imports torch: only once a target is known
    from models.target_families import UnsupportedArchitecture, family_of

    problems = []
    if dims.model_type is not None:
        try:
            family_of(dims.model_type)
        except UnsupportedArchitecture as error:
            problems.append(f"model: {error} (target: {dims.origin})")
    try:
        resolve_aux_layer_ids(cfg.capture.aux_layer_ids, dims.num_hidden_layers)
    except ValueError as error:
        problems.append(f"{error} (target: {dims.origin})")
    wanted = cfg.capture.draft_vocab_size
    if wanted is not None and wanted > dims.vocab_size:
        problems.append(f"capture.draft_vocab_size: {wanted} is more than the target's vocabulary of "
                        f"{dims.vocab_size} tokens (target: {dims.origin})")
    return problems


# --- the trainer's ranks ----------------------------------------------------------------------------------


def rank_problems(cfg: RunConfig) -> list[str]:
    wanted = cfg.deployment.trainer.nproc_per_node
    if wanted == 1:
        return []  # one rank runs anywhere (and saying so needs no torch import)
    available, kind = rank_slots(cfg.runtime.device)
    if wanted <= available:
        return []
    return [f"deployment.trainer.nproc_per_node: {wanted} ranks, but this host has {available} {kind} "
            f"(runtime.device {cfg.runtime.device})"]


def rank_slots(device_setting: str) -> tuple[int, str]:
    """Where torchrun's ranks go (tasks/training/parallel.py): one GPU each under nccl when the trainer runs on
    CUDA; otherwise gloo processes, one per usable CPU core (more would only take turns on the same cores)."""
    import torch

    from tasks.common.devices import resolve_device

    try:
        on_gpu = resolve_device(device_setting).type == "cuda"
    except ValueError:  # runtime.device cuda on a host that has none
        on_gpu = True
    if on_gpu:
        return torch.cuda.device_count(), "visible CUDA devices"
    return usable_cpus(), "usable CPU cores"


def usable_cpus() -> int:
    """The cores this process may run on (a container's or taskset's share, not the whole machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# --- the engines ------------------------------------------------------------------------------------------


def engines_in_use(cfg: RunConfig) -> dict[str, str]:
    """Each engine the run starts, with the setting that makes it start it."""
    used: dict[str, str] = {}
    regeneration = cfg.regeneration
    if regeneration.enabled and regeneration.backend == "openai" and not regeneration.base_url and regeneration.engine:
        used[regeneration.engine] = "regeneration.engine"
    if cfg.capture.backend == "vllm":
        used.setdefault("vllm", "capture.backend")
    for kind in cfg.benchmark.engines:
        used.setdefault(kind, "benchmark.engines")
    return used


def engine_problems(cfg: RunConfig) -> list[str]:
    """An engine whose python is missing would fail its stage at once (EngineMissing, not retried)."""
    problems = []
    for kind, user in engines_in_use(cfg).items():
        python = cfg.runtime.engines[kind].python
        if resolve_python(python) is None:
            problems.append(f"runtime.engines.{kind}.python: {python!r} is not an executable python (a relative "
                            f"path is looked up from here, then from the repository root); {user} starts this "
                            f"engine: {ENV_HINTS[kind]}")
    return problems
