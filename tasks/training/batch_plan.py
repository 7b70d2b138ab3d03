"""Which records each training step sees: seeded per-epoch order (shard-aware: `training.shuffle_buffer_shards`),
packed into a token budget, grouped into optimizer steps of `grad_accumulation` micro-batches, split by rank.

The plan does not depend on the world size, so N ranks run exactly the steps of one; a rank takes the
records at positions rank, rank + world, ... of each global batch (a rank left without one computes a
zero-weight pass, so the collective calls still line up). Nothing is dropped or padded in.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Cursor:
    """Where training stands in the data: the next batch of the given epoch."""

    epoch: int = 0
    batch: int = 0


def epoch_order(shard_of: list[int], seed: int, epoch: int, buffer_shards: int) -> list[int]:
    """Record positions in one epoch's order, shard-aware: the shards are shuffled, then the records of each
    group of `buffer_shards` consecutive shards are shuffled together, so a reader works through a bounded window
    of shards at a time. With every shard in one group this is the plain seeded shuffle of all records."""
    shards = sorted(set(shard_of))
    if len(shards) > buffer_shards:
        random.Random(f"{seed}:{epoch}:shards").shuffle(shards)
    groups = [shards[start:start + buffer_shards] for start in range(0, len(shards), buffer_shards)]
    members: dict[int, list[int]] = defaultdict(list)
    for position, shard in enumerate(shard_of):
        members[shard].append(position)
    order: list[int] = []
    for number, group in enumerate(groups):
        block = sorted(position for shard in group for position in members[shard])
        random.Random(f"{seed}:{epoch}" if len(groups) == 1 else f"{seed}:{epoch}:{number}").shuffle(block)
        order.extend(block)
    return order


def epoch_batches(lengths: list[int], tokens_per_step: int, seed: int, epoch: int,
                  shard_of: list[int] | None = None, buffer_shards: int = 1, length_window: int = 1) -> list[list[int]]:
    """Record indices per global batch for one epoch (in `epoch_order`; records without shards are one group); a
    batch's padded size (count x longest) fits the budget unless a single record is longer than the budget.

    With `length_window` > 1 each consecutive window of that many records (in the epoch's order) is packed on its
    own, sorted by length, and its batches shuffled: records of like length share a batch, so less of it is
    padding (the embedded default's batches: 26 % padding in the epoch's order, 10 % in windows of 64)."""
    if not lengths:
        raise ValueError("no training records")
    order = epoch_order(shard_of if shard_of is not None else [0] * len(lengths), seed, epoch, buffer_shards)
    if length_window <= 1:
        return packed(order, lengths, tokens_per_step)
    batches: list[list[int]] = []
    for start in range(0, len(order), length_window):
        window = sorted(order[start:start + length_window], key=lambda index: lengths[index])
        window_batches = packed(window, lengths, tokens_per_step)
        random.Random(f"{seed}:{epoch}:lengths:{start}").shuffle(window_batches)
        batches.extend(window_batches)
    return batches


def packed(order: list[int], lengths: list[int], tokens_per_step: int) -> list[list[int]]:
    """The records in this order, cut into batches whose count x longest fits `tokens_per_step`."""
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
