"""What an in-process stage (evaluate, capture) leaves on the device is handed back before the next stage starts an
engine on the same GPU (tasks/common/devices.py release_device_memory, called by flows/stage_records.recorded)."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from contract.config import RunConfig
from flows.stage_records import recorded


@dataclass
class StageResult:
    """The shape every stage returns: a summary and its reports."""

    values: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        return self.values

    def reports(self) -> list[Path]:
        return []


def test_a_stage_model_held_in_a_reference_cycle_is_gone_when_the_stage_returns() -> None:
    models: list[weakref.ref[Any]] = []

    def stage(cfg: RunConfig) -> StageResult:
        model = torch.nn.Linear(256, 256)
        model.loop = [model]  # a cycle, as a model with hooks or a cache pointing back at it holds
        models.append(weakref.ref(model))
        return StageResult({"rows": 1.0})

    gc.disable()  # only the stage wrapper may collect: the cycle outlives a plain return
    try:
        record = recorded(stage)(RunConfig())
    finally:
        gc.enable()
    assert record["summary"] == {"rows": 1.0}
    assert models[0]() is None, "the stage's model (and its weights) are freed before the next stage runs"


def test_a_failing_stage_still_releases_what_it_collected() -> None:
    models: list[weakref.ref[Any]] = []

    def stage(cfg: RunConfig) -> StageResult:
        model = torch.nn.Linear(8, 8)
        model.loop = [model]
        models.append(weakref.ref(model))
        del model
        raise RuntimeError("the stage failed")

    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="the stage failed"):
            recorded(stage)(RunConfig())
    finally:
        gc.enable()
    assert models[0]() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA caching allocator needs a CUDA device")
def test_the_cuda_memory_a_stage_reserved_goes_back_to_the_driver() -> None:
    def stage(cfg: RunConfig) -> StageResult:
        weights = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        return StageResult({"bytes": float(weights.numel())})

    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    recorded(stage)(RunConfig())
    assert torch.cuda.memory_reserved() <= before, "the allocator keeps no block the stage freed"
