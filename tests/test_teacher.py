"""The teacher (models/teacher.py): chunked and in the compute dtype, it equals the full-vocabulary fp32 softmax
it replaces (exactly in fp32; within bf16's rounding in bf16, with the same top-1)."""

from __future__ import annotations

import pytest
import torch

from models.teacher import TOP1_CANDIDATES, Settled, Teacher
from models.ttt import renormalised

VOCAB, HIDDEN, DRAFT_VOCAB = 4096, 64, 1024


def draft_vocab(generator: torch.Generator) -> torch.Tensor:
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.randperm(VOCAB, generator=generator)[:DRAFT_VOCAB]] = True
    return t2d


def lm_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """States and an lm_head giving logits of a real model's scale (std ~4, row maxima ~15)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 37, HIDDEN, generator=generator) * 4
    lm_head = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.125
    return hidden, lm_head, draft_vocab(generator)


def reference(hidden: torch.Tensor, lm_head: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher as first written: the whole fp32 softmax, then the draft tokens' columns."""
    logits = hidden @ lm_head.T
    return torch.softmax(logits, dim=-1)[..., t2d], logits.argmax(dim=-1)


def kl_per_position(expected: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """KL(expected || actual) of the distributions the loss teaches (renormalised over the draft vocab)."""
    p, q = renormalised(expected), renormalised(actual)
    return (p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log())).sum(-1)


def test_the_fp32_teacher_in_chunks_is_the_full_softmax() -> None:
    hidden, lm_head, t2d = lm_inputs(0)
    probs, top1, in_draft = Teacher(lm_head, t2d, rows_per_chunk=10)(hidden)   # 74 rows: 8 chunks, the last short
    expected_probs, expected_top1 = reference(hidden, lm_head, t2d)
    assert probs.shape == (2, 37, DRAFT_VOCAB) and probs.dtype == torch.float32
    torch.testing.assert_close(probs, expected_probs, rtol=1e-5, atol=1e-7)
    assert torch.equal(top1, expected_top1) and torch.equal(in_draft, t2d[expected_top1])
    assert bool((probs.sum(-1) < 1).all()), "the mass outside the draft vocab is kept out, not renormalised in"


def test_the_bf16_teacher_keeps_the_top1_and_is_within_bf16_rounding() -> None:
    hidden, lm_head, t2d = lm_inputs(1)
    probs, top1, in_draft = Teacher(lm_head, t2d, torch.bfloat16, rows_per_chunk=16)(hidden)
    expected_probs, expected_top1 = reference(hidden, lm_head, t2d)
    assert probs.dtype == torch.float32, "the log-sum-exp and the probabilities are fp32"
    assert torch.equal(top1, expected_top1) and torch.equal(in_draft, t2d[expected_top1])
    divergence = kl_per_position(expected_probs, probs)
    assert float(divergence.max()) < 2e-3, f"KL to the fp32 teacher up to {float(divergence.max()):.2e} nats"
    torch.testing.assert_close(probs.sum(-1), expected_probs.sum(-1), rtol=0.05, atol=1e-4)


def test_a_near_tie_that_bf16_reorders_is_settled_in_fp32() -> None:
    """Two vocabulary rows whose fp32 logits differ by less than bf16 can tell apart: the top-1 is the fp32 one."""
    generator = torch.Generator().manual_seed(3)
    noise = torch.randn(64, HIDDEN, generator=generator) * 0.1
    lm_head = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.01
    winner = torch.randn(HIDDEN, generator=generator)
    lm_head[7] = winner                                       # a strong row ...
    lm_head[9] = winner * (1 + 2 ** -12)                      # ... and one just above it (in fp32 only)
    hidden = winner * 0.5 + noise                             # both lead by far on every row (logits ~30)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[:DRAFT_VOCAB] = True
    _, expected_top1 = reference(hidden, lm_head, t2d)
    assert bool((expected_top1 == 9).all())
    rounded = (hidden.bfloat16() @ lm_head.bfloat16().T).argmax(-1)
    assert not bool((rounded == 9).all()), "bf16 alone must lose some of these ties, or the test proves nothing"
    _, top1, _ = Teacher(lm_head, t2d, torch.bfloat16)(hidden)
    assert torch.equal(top1, expected_top1), f"rescoring the best {TOP1_CANDIDATES} bf16 logits in fp32 keeps it"


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-3)])
def test_without_the_outside_mass_it_is_what_the_loss_teaches(dtype: torch.dtype, tolerance: float) -> None:
    """A training step's teacher: the draft-vocab softmax, equal to the full teacher renormalised (same top-1)."""
    hidden, lm_head, t2d = lm_inputs(5)
    full = Teacher(lm_head, t2d, dtype)
    probs, top1, in_draft = full.with_outside_mass(False)(hidden)
    expected_probs, expected_top1 = reference(hidden, lm_head, t2d)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 37), rtol=0, atol=1e-5)
    assert float(kl_per_position(expected_probs, probs).max()) < tolerance
    assert torch.equal(top1, expected_top1) and torch.equal(in_draft, t2d[expected_top1])
    assert full.outside_mass and not full.with_outside_mass(False).outside_mass, "a copy: the original keeps its mode"


def test_the_teacher_ignores_an_enclosing_autocast() -> None:
    """The trainer calls it inside its autocast region (evaluation); its dtype is its own."""
    hidden, lm_head, t2d = lm_inputs(4)
    outside = Teacher(lm_head, t2d)(hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = Teacher(lm_head, t2d)(hidden)
    torch.testing.assert_close(inside[0], outside[0], rtol=0, atol=0)


@pytest.mark.parametrize("outside_mass", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_known_settled_values_skip_the_full_vocabulary_pass_and_change_nothing(
        dtype: torch.dtype, outside_mass: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Later epochs and evaluations pass back what the teacher settled before: the same teaching, without the
    full-vocabulary pass."""
    hidden, lm_head, t2d = lm_inputs(6)
    teacher = Teacher(lm_head, t2d, dtype, rows_per_chunk=16, outside_mass=outside_mass)
    first = teacher.teach(hidden)
    assert (first.settled.log_normaliser is not None) == outside_mass
    assert first.settled.top1.shape == (2 * 37,)

    def no_full_pass(*_: object) -> torch.Tensor:
        raise AssertionError("the full-vocabulary pass ran although its values were known")

    monkeypatch.setattr(teacher, "full_pass", no_full_pass)
    again = teacher.teach(hidden, first.settled)
    for name in ("probs", "top1", "in_draft"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    if not outside_mass:
        with pytest.raises(ValueError, match="log-normaliser"):
            teacher.with_outside_mass(True).teach(hidden, first.settled)


def test_settled_values_split_per_record_and_join_back() -> None:
    hidden, lm_head, t2d = lm_inputs(8)
    settled = Teacher(lm_head, t2d).teach(hidden).settled
    parts = settled.split([30, 44])
    assert [part.top1.shape[0] for part in parts] == [30, 44]
    joined = Settled.joined(parts)
    assert torch.equal(joined.top1, settled.top1) and torch.equal(joined.log_normaliser, settled.log_normaliser)


def test_collate_with_a_settled_cache_gives_the_same_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's SettledCache: a record's second batch reuses its top-1 and equals a batch built without it."""
    from tasks.features.batches import SettledCache, collate

    hidden, lm_head, t2d = lm_inputs(7)
    generator = torch.Generator().manual_seed(7)
    records = [{"input_ids": torch.randint(0, VOCAB, (length,), generator=generator),
                "loss_mask": torch.ones(length, dtype=torch.long),
                "hidden_state": hidden[0, :length], "aux_hidden_state": torch.randn(length, 3 * HIDDEN)}
               for length in (37, 20)]
    teacher = Teacher(lm_head, t2d, outside_mass=False)
    cache = SettledCache()
    plain = collate(records, teacher)
    first = collate(records, teacher, keys=[4, 9], cache=cache)
    assert sorted(cache.settled) == [4, 9] and cache.settled[9].top1.shape == (20,)
    monkeypatch.setattr(teacher, "full_pass", lambda *_: pytest.fail("the cached top-1 was not used"))
    second = collate(records, teacher, keys=[4, 9], cache=cache)
    for name in ("target_probs", "target_top1", "target_top1_in_draft", "input_ids", "aux_hidden_state"):
        assert torch.equal(getattr(plain, name), getattr(first, name)), name
        assert torch.equal(getattr(plain, name), getattr(second, name)), name


@pytest.mark.parametrize("method", ["eagle3", "peagle", "dflash"])
def test_a_batch_taught_only_at_the_rows_objectives_read_trains_as_one_taught_everywhere(method: str) -> None:
    """collate computes the teacher at `taught_rows` alone (supervised tokens and the row before each): every
    method's loss, gradients and metrics equal those of the same batch with the teacher at every row."""
    import copy

    from models.draft_methods import draft_objective
    from tasks.features.batches import collate, taught_rows
    from test_dflash import tiny_dflash
    from test_ttt import TINY, tiny_draft

    draft = tiny_dflash() if method == "dflash" else tiny_draft(method=method)
    generator = torch.Generator().manual_seed(11)
    lm_head = torch.randn(TINY.vocab_size, TINY.target_hidden_size, generator=generator) * 0.5
    records = []
    for length, spans in [(24, [(6, 9), (10, 13), (14, 17), (22, 24)]), (12, [(3, 9)])]:  # gaps of one: DFlash
        loss_mask = torch.zeros(length, dtype=torch.long)
        for start, end in spans:
            loss_mask[start:end] = 1
        records.append({"input_ids": torch.randint(0, TINY.vocab_size, (length,), generator=generator),
                        "loss_mask": loss_mask,
                        "hidden_state": torch.randn(length, TINY.target_hidden_size, generator=generator) * 4,
                        "aux_hidden_state": torch.randn(length, 3 * TINY.target_hidden_size, generator=generator)})
    teacher = Teacher(lm_head, draft.t2d, outside_mass=True)
    taught = collate(records, teacher)
    everywhere = copy.deepcopy(taught)
    for row, record in enumerate(records):
        count = len(record["input_ids"])
        probs, top1, in_draft = teacher(record["hidden_state"])
        everywhere.target_probs[row, :count], everywhere.target_top1[row, :count] = probs, top1
        everywhere.target_top1_in_draft[row, :count] = in_draft
        skipped = torch.ones(count, dtype=torch.bool)
        skipped[taught_rows(record["loss_mask"])] = False
        assert skipped.sum() == count - len(taught_rows(record["loss_mask"])) > 0
        assert not taught.target_probs[row, :count][skipped].any(), "prompt rows were taught"
    assert taught_rows(records[0]["loss_mask"]).tolist() == [*range(5, 17), 21, 22, 23]

    outputs, gradients = [], []
    for batch in (taught, everywhere):
        torch.manual_seed(5)  # DFlash draws its anchors from the global generator
        output = draft_objective(draft, batch, 3)
        outputs.append(output)
        gradients.append(torch.autograd.grad(output.loss, [p for p in draft.parameters() if p.requires_grad]))
    torch.testing.assert_close(outputs[0].loss, outputs[1].loss, rtol=1e-6, atol=1e-7)
    assert outputs[0].loss > 0
    assert outputs[0].acc == outputs[1].acc and outputs[0].supervised == outputs[1].supervised
    assert outputs[0].expected_accept == pytest.approx(outputs[1].expected_accept, rel=1e-6)
    for got, want in zip(*gradients):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
