"""How a run's engine executes: the dtype it serves the target and the drafter in, eager or CUDA graphs, its GPUs.

runtime.engines.<kind> says it (`dtype`, `enforce_eager`, `gpus`); `auto` is resolved here from the run. The dtype is
`model.dtype`: the target's, and the one the train stage exports the drafter in (config.json `torch_dtype`), so
neither engine's own `auto` guesses a drafter dtype beside the target's. Eager where runtime.device resolves to the
CPU (vLLM's CPU build: float32 and eager, greedy outputs token for token those of transformers), CUDA graphs on a
GPU. The benchmark and `eaglet serve` build their launches here, so both serve what the other measured, and the
benchmark report records `EngineExecution.as_report()` per engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from contract.config import RunConfig
from tasks.serving.engine import EngineKind, EngineLaunch


@dataclass(frozen=True)
class EngineExecution:
    """runtime.engines.<kind> with `auto` resolved for this run."""

    dtype: str
    enforce_eager: bool
    gpus: Optional[str]

    def as_report(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def runs_on_gpu(device: str) -> bool:
    """Whether runtime.device puts the run on a GPU. Unlike tasks/common/devices.py `resolve_device`, `cuda` is
    taken at its word where no GPU is visible here, so `eaglet serve --print` of a GPU recipe prints its GPU command."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device == "cuda"


def engine_execution(cfg: RunConfig, kind: EngineKind) -> EngineExecution:
    """The dtype (auto: model.dtype), eager or CUDA graphs (auto: eager on the CPU only) and GPUs of `kind`."""
    engine = cfg.runtime.engines[kind]
    dtype = cfg.model.dtype if engine.dtype == "auto" else engine.dtype
    eager = not runs_on_gpu(cfg.runtime.device) if engine.enforce_eager == "auto" else engine.enforce_eager
    return EngineExecution(dtype=dtype, enforce_eager=eager, gpus=engine.gpus)


def run_launch(cfg: RunConfig, kind: EngineKind, *, model: Path, log_path: Path, **launch_fields: Any) -> EngineLaunch:
    """`EngineLaunch.from_config` of runtime.engines.<kind>, executing as `engine_execution` resolves it."""
    execution = engine_execution(cfg, kind)
    launch = EngineLaunch.from_config(kind, cfg.runtime.engines[kind], model=model, log_path=log_path, **launch_fields)
    return dataclasses.replace(launch, dtype=execution.dtype, enforce_eager=execution.enforce_eager,
                              gpus=execution.gpus)
