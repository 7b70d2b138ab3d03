"""Proof that an engine's states are the target's states at the layers eaglet meant (`capture.verify_fraction`).

A sample of the records the engine captured is run through the target in-process. For each slot the engine
returned, the raw output of *every* decoder layer is compared with it: the slot must match its intended layer
best (an off-by-one layer numbering between eaglet and the engine shows as a slot matching its neighbour), and
the difference must stay within the target dtype's tolerance (kernels differ between engines, so equality is
not expected). The final state is compared after our norm with the target's own normed state.

Relative difference of two [T, H] states: max |a - b| / max |b|.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from models.target_capture import every_layer_output
from tasks.features.engine_states import EngineCaptureError, EngineStates
from tasks.features.preparation import Sample

#: The largest relative difference accepted per target dtype: fp32 engines measured ~4e-4 on SmolLM2's 30 layers.
TOLERANCE: dict[str, float] = {"float32": 5e-3, "float16": 2e-2, "bfloat16": 5e-2}
FINAL_SLOT = "final (normed)"


@dataclass
class SlotCheck:
    """One engine slot over the verified records."""

    slot: str
    engine_layer_id: int
    expected_layer: int
    max_relative_difference: float = 0.0
    worst_record: str = ""


def relative_difference(engine: torch.Tensor, local: torch.Tensor) -> float:
    scale = local.float().abs().max().clamp_min(1e-12)
    return float((engine.float() - local.float()).abs().max() / scale)


def verification_sample(samples: list[Sample], fraction: float) -> list[Sample]:
    """`fraction` of the samples (at least one when > 0), evenly spaced so every part of the data is seen."""
    if fraction <= 0 or not samples:
        return []
    count = min(len(samples), max(1, math.ceil(fraction * len(samples))))
    step = len(samples) / count
    return [samples[int(index * step)] for index in range(count)]


def verify_engine_states(source: EngineStates, model: Any, samples: list[Sample], aux_ids: list[int],
                         dtype: str) -> dict[str, Any]:
    """Compare the engine with the in-process target on `samples`; raise EngineCaptureError naming the record,
    slot and difference on a layer mismatch or a difference beyond TOLERANCE[dtype]. Returns the figures."""
    num_layers = int(model.config.num_hidden_layers)
    expected = [*aux_ids, num_layers - 1]
    slots = [SlotCheck(f"aux {index}", layer_id, layer)
             for index, (layer_id, layer) in enumerate(zip(source.layer_ids, expected[:-1]))]
    slots.append(SlotCheck("last layer", source.layer_ids[-1], expected[-1]))
    slots.append(SlotCheck(FINAL_SLOT, source.layer_ids[-1], expected[-1]))
    tolerance = TOLERANCE[dtype]
    with source.client() as client:
        for sample in samples:
            raw = source.raw_states(sample, client)
            layers, normed = every_layer_output(model, sample.input_ids)
            for index, check in enumerate(slots[:-1]):
                differences = [relative_difference(raw[:, index], layers[layer]) for layer in range(num_layers)]
                best = min(range(num_layers), key=differences.__getitem__)
                if best != check.expected_layer:
                    raise EngineCaptureError(
                        f"record {sample.id} ({sample.key}): engine slot '{check.slot}' (vLLM layer id "
                        f"{check.engine_layer_id}) matches decoder layer {best} best (relative difference "
                        f"{differences[best]:.2e}), not layer {check.expected_layer} "
                        f"({differences[check.expected_layer]:.2e}): eaglet and the engine number layers differently")
                record_worst(check, differences[best], sample)
            record_worst(slots[-1], relative_difference(source.split(raw)[1], normed), sample)
    for check in slots:
        if check.max_relative_difference > tolerance:
            raise EngineCaptureError(
                f"record {check.worst_record}: engine slot '{check.slot}' (layer {check.expected_layer}) differs from "
                f"the in-process target by {check.max_relative_difference:.2e} relative, beyond the {dtype} "
                f"tolerance {tolerance:g}")
    return {"records": [sample.id for sample in samples], "tolerance": tolerance, "dtype": dtype,
            "slots": [asdict(check) for check in slots]}


def record_worst(check: SlotCheck, difference: float, sample: Sample) -> None:
    if difference >= check.max_relative_difference:
        check.max_relative_difference = difference
        check.worst_record = f"{sample.id} ({sample.key})"
