"""Offline features that stream: a shard-aware, seeded epoch order and memory-mapped record reads."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tasks.features import shards
from tasks.features.shards import FeatureSet, load_shard
from tasks.training.batch_plan import epoch_batches, epoch_order


def test_with_every_shard_in_one_group_the_order_is_the_plain_seeded_shuffle() -> None:
    shard_of = [index // 4 for index in range(40)]
    plain = list(range(40))
    random.Random("7:2").shuffle(plain)
    assert epoch_order(shard_of, seed=7, epoch=2, buffer_shards=10) == plain
    assert epoch_batches([5] * 40, 20, 7, 2) == epoch_batches([5] * 40, 20, 7, 2, shard_of, 16)


def test_a_small_buffer_works_through_a_bounded_window_of_shards() -> None:
    shard_of = [index // 5 for index in range(50)]  # 10 shards of 5 records
    order = epoch_order(shard_of, seed=3, epoch=0, buffer_shards=3)
    assert sorted(order) == list(range(50)), "every record once"
    windows = [order[start:start + size] for start, size in zip((0, 15, 30, 45), (15, 15, 15, 5))]
    for window in windows:
        assert len({shard_of[position] for position in window}) <= 3, "a window spans at most buffer_shards shards"
    first_shards = [shard_of[position] for position in order[::5]]
    assert sorted({shard_of[p] for p in windows[0]}) != [0, 1, 2] or first_shards != sorted(first_shards), \
        "the shards themselves are shuffled"
    assert order == epoch_order(shard_of, seed=3, epoch=0, buffer_shards=3), "deterministic from the seed"
    assert order != epoch_order(shard_of, seed=3, epoch=1, buffer_shards=3), "another order each epoch"


@pytest.fixture(scope="module")
def features(captured_tiny_run) -> FeatureSet:
    return FeatureSet(captured_tiny_run.output_path / "features", "train", verify=True)


def test_records_are_read_from_the_mapped_shard_as_the_whole_shard_holds_them(features: FeatureSet,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shards, "OPEN_SHARDS", 2)
    assert len(features.shards) > shards.OPEN_SHARDS, "the tiny run has more shards than are kept open"
    expected = {}
    for shard in features.shards:
        tensors, record_ids, _ = load_shard(shard.path, features.mode)
        offsets = tensors["offsets"]
        for position, record_id in enumerate(record_ids):
            start, end = int(offsets[position]), int(offsets[position + 1])
            expected[record_id] = {name: value[start:end] for name, value in tensors.items() if name != "offsets"}
    order = list(range(len(features)))
    random.Random(0).shuffle(order)
    for position in order:
        record = features[position]
        want = expected[record["id"]]
        assert set(record) - {"id"} == set(want)
        assert all(torch.equal(record[name], want[name]) for name in want), record["id"]
        assert len(features._open) <= shards.OPEN_SHARDS
    assert [entry[0] for entry in features.index()] == [record["id"] for record in features]
    assert features.shard_of() == [s for s, shard in enumerate(features.shards) for _ in range(shard.records)]
