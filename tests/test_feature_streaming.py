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


def test_length_windows_pack_like_lengths_together_and_keep_every_record_once() -> None:
    generator = random.Random(5)
    lengths = [min(1000, 30 + int(generator.expovariate(1 / 200))) for _ in range(300)]  # mostly short, as chats are

    def padded(batches: list[list[int]]) -> int:
        return sum(len(batch) * max(lengths[index] for index in batch) for batch in batches)

    plain = epoch_batches(lengths, 1024, seed=1, epoch=0)
    assert epoch_batches(lengths, 1024, seed=1, epoch=0, length_window=1) == plain
    for window in (16, 64, 300):
        grouped = epoch_batches(lengths, 1024, seed=1, epoch=0, length_window=window)
        assert sorted(index for batch in grouped for index in batch) == list(range(300)), "every record once"
        assert all(len(batch) * max(lengths[index] for index in batch) <= 1024 for batch in grouped)
        assert window < 64 or padded(grouped) < 0.9 * padded(plain), (window, padded(grouped), padded(plain))
        assert grouped == epoch_batches(lengths, 1024, seed=1, epoch=0, length_window=window), "seeded"
        assert grouped != epoch_batches(lengths, 1024, seed=1, epoch=1, length_window=window), "another epoch"
        order = epoch_order([0] * 300, 1, 0, 1)
        for batch in grouped:
            windows = {order.index(index) // window for index in batch}
            assert len(windows) == 1, "a batch never mixes two windows of the epoch's order"
    ascending = [max(lengths[index] for index in batch) for batch in epoch_batches(lengths, 1024, 1, 0, length_window=300)]
    assert ascending != sorted(ascending), "a window's batches are shuffled, not served shortest first"


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
