"""Which records each training step sees: seeded per-epoch order, packed into a token budget, grouped into
optimizer steps of `grad_accumulation` micro-batches, split by rank.

The plan does not depend on the world size, so N ranks run exactly the steps of one; a rank takes the
records at positions rank, rank + world, ... of each global batch (a rank left without one computes a
zero-weight pass, so the collective calls still line up). Nothing is dropped or padded in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Cursor:
    """Where training stands in the data: the next batch of the given epoch."""

    epoch: int = 0
    batch: int = 0


def epoch_batches(lengths: list[int], tokens_per_step: int, seed: int, epoch: int) -> list[list[int]]:
    """Record indices per global batch for one epoch; a batch's padded size (count x longest) fits the budget
    unless a single record is longer than the budget."""
    if not lengths:
        raise ValueError("no training records")
    order = list(range(len(lengths)))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        grown = max(longest, lengths[index])
        if current and grown * (len(current) + 1) > tokens_per_step:
            batches.append(current)
            current, grown = [], lengths[index]
        current.append(index)
        longest = grown
    batches.append(current)
    return batches


def rank_share(batch: list[int], rank: int, world_size: int) -> list[int]:
    return batch[rank::world_size]


def optimizer_steps(batches: list[list[int]], accumulation: int) -> list[list[list[int]]]:
    """Consecutive micro-batches grouped into optimizer steps (the last step of an epoch may hold fewer)."""
    return [batches[start:start + accumulation] for start in range(0, len(batches), accumulation)]
