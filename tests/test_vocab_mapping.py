"""The draft vocab mapping: most frequent supervised tokens, ties by smaller id, padding, d2t/t2d, storage."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from models.vocab_mapping import (build_vocab_mapping, count_tokens, load_vocab_mapping, mapping_hash,
                                  mapping_summary, save_vocab_mapping)


def test_most_frequent_supervised_tokens_sorted_ascending() -> None:
    sequences = [([5, 9, 9, 3, 7, 7, 7], [1, 1, 1, 0, 1, 1, 1]), ([3, 3, 3, 8], [0, 0, 0, 1])]
    counts = count_tokens(sequences, vocab_size=12)
    assert counts.tolist() == [0, 0, 0, 0, 0, 1, 0, 3, 1, 2, 0, 0], "unmasked tokens (the 3s) are not counted"
    mapping = build_vocab_mapping(counts, vocab_size=12, draft_vocab_size=3)
    assert mapping.used_ids.tolist() == [5, 7, 9], "7 (3x), 9 (2x), then 5 beats 8 on the tie (smaller id)"
    assert mapping.d2t.dtype == torch.int64 and mapping.d2t.tolist() == [5, 6, 7]
    assert mapping.t2d.dtype == torch.bool and mapping.t2d.nonzero().flatten().tolist() == [5, 7, 9]


def test_ties_break_by_smaller_id_and_counter_input() -> None:
    mapping = build_vocab_mapping(Counter({10: 4, 2: 4, 6: 4, 1: 9}), vocab_size=16, draft_vocab_size=3)
    assert mapping.used_ids.tolist() == [1, 2, 6]


def test_padding_with_smallest_unused_ids_when_few_tokens_seen() -> None:
    mapping = build_vocab_mapping(Counter({7: 2, 1: 5}), vocab_size=10, draft_vocab_size=5)
    assert mapping.used_ids.tolist() == [0, 1, 2, 3, 7], "seen 1 and 7, then unused 0, 2, 3"
    summary = mapping_summary(mapping, build_counts({7: 2, 1: 5}, 10))
    assert summary["padding_ids"] == 3 and summary["coverage"] == 1.0 and summary["distinct_tokens_seen"] == 2


def build_counts(counter: dict[int, int], vocab: int) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.int64)
    for key, value in counter.items():
        counts[key] = value
    return counts


def test_d2t_t2d_round_trip() -> None:
    generator = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (300,), generator=generator)
    mapping = build_vocab_mapping(counts, vocab_size=300, draft_vocab_size=40)
    used = torch.nonzero(mapping.t2d).flatten()
    assert int(mapping.t2d.sum()) == 40
    assert torch.equal(torch.arange(40) + mapping.d2t, used), "used[i] == i + d2t[i]"
    draft = torch.arange(40)
    assert torch.equal(mapping.draft_to_target(draft), used)
    assert torch.equal(mapping.target_to_draft(used), draft)
    assert mapping.target_to_draft_mask(used).all() and not mapping.target_to_draft_mask(torch.tensor([i for i in range(300) if i not in set(used.tolist())])).any()
    outside = int((~mapping.t2d).nonzero()[0])
    assert int(mapping.target_to_draft(torch.tensor(outside))) == -1
    # the kept ids are the 40 most frequent (ties by smaller id)
    expected = sorted(sorted(range(300), key=lambda i: (-int(counts[i]), i))[:40])
    assert used.tolist() == expected


@pytest.mark.parametrize("draft_vocab_size", [None, 50])
def test_identity_when_draft_vocab_is_the_full_vocab(draft_vocab_size: int | None) -> None:
    mapping = build_vocab_mapping(Counter({3: 1}), vocab_size=50, draft_vocab_size=draft_vocab_size)
    assert mapping.is_identity and mapping.d2t.tolist() == [0] * 50 and bool(mapping.t2d.all())


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="draft_vocab_size = 60"):
        build_vocab_mapping(Counter(), vocab_size=50, draft_vocab_size=60)
    with pytest.raises(ValueError, match="token id 50"):
        build_vocab_mapping(Counter({50: 1}), vocab_size=50, draft_vocab_size=10)
    with pytest.raises(ValueError, match="token id 9"):
        count_tokens([([9], [1])], vocab_size=9)


def test_save_load_hash_are_deterministic(tmp_path: Path) -> None:
    counts = torch.arange(100) % 7
    mapping = build_vocab_mapping(counts, vocab_size=100, draft_vocab_size=20)
    first, second = tmp_path / "a" / "vocab_mapping.safetensors", tmp_path / "b" / "vocab_mapping.safetensors"
    digest = save_vocab_mapping(mapping, first, mapping_summary(mapping, counts))
    assert digest == mapping_hash(first) == save_vocab_mapping(mapping, second, mapping_summary(mapping, counts))
    loaded = load_vocab_mapping(first)
    assert torch.equal(loaded.d2t, mapping.d2t) and torch.equal(loaded.t2d, mapping.t2d)
    with safe_open(str(first), framework="pt") as handle:
        metadata = handle.metadata()
        assert set(handle.keys()) == {"d2t", "t2d"}
    assert metadata["draft_vocab_size"] == "20" and metadata["vocab_size"] == "100" and '"coverage"' in metadata["summary"]
    other = build_vocab_mapping(counts, vocab_size=100, draft_vocab_size=21)
    assert save_vocab_mapping(other, tmp_path / "c.safetensors") != digest
    first.write_bytes(first.read_bytes()[:-10])
    with pytest.raises(ValueError, match="vocab_mapping.safetensors"):
        load_vocab_mapping(first)
