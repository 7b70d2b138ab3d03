"""The training-time-test loss equals a straightforward dense per-step reference, in values and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from models.eagle3 import Eagle3Config, Eagle3Draft
from models.ttt import TTTBatch, causal_plus_diagonal_attention, ttt_forward

TINY = Eagle3Config(
    hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256, vocab_size=80, draft_vocab_size=50,
    target_hidden_size=32, aux_layer_ids=[1, 2, 3],
)


def tiny_draft(seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    draft = Eagle3Draft(TINY)
    for parameter in draft.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    draft.attach_embedding(torch.randn(TINY.vocab_size, TINY.hidden_size))
    used = torch.sort(torch.randperm(TINY.vocab_size)[: TINY.draft_vocab_size]).values
    t2d = torch.zeros(TINY.vocab_size, dtype=torch.bool)
    t2d[used] = True
    draft.set_vocab_mapping(used - torch.arange(TINY.draft_vocab_size), t2d)
    return draft


def random_batch(batch: int = 2, length: int = 12, seed: int = 1) -> TTTBatch:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, TINY.draft_vocab_size, generator=generator) * 2
    mask = (torch.rand(batch, length, generator=generator) > 0.3).long()
    return TTTBatch(
        input_ids=torch.randint(0, TINY.vocab_size, (batch, length), generator=generator),
        loss_mask=mask,
        aux_hidden_state=torch.randn(batch, length, 3 * TINY.target_hidden_size, generator=generator),
        target_probs=torch.softmax(logits, dim=-1),
        target_top1=torch.randint(0, TINY.vocab_size, (batch, length), generator=generator),
        target_top1_in_draft=torch.rand(batch, length, generator=generator) > 0.2,
    )


def reference_ttt_loss(draft: Eagle3Draft, batch: TTTBatch, steps: int) -> torch.Tensor:
    """docs/architecture.md §3 spelled out: per step, explicit shifts, a dense mask over all keys so far,
    the weighted loss."""
    size, length = batch.input_ids.shape

    def at(tensor: torch.Tensor, t: int, fill: float = 0.0) -> torch.Tensor:
        return tensor[:, t] if t < length else torch.full_like(tensor[:, 0], fill)

    weights = batch.loss_mask.float() * batch.target_top1_in_draft.float()
    hidden = draft.fc(batch.aux_hidden_state)
    all_keys, all_values = [], []
    total = torch.zeros(())
    for step in range(steps):
        ids = torch.stack([at(batch.input_ids, t + 1 + step) for t in range(length)], dim=1).long()
        mask = torch.stack([at(weights, t + 1 + step) for t in range(length)], dim=1)
        probs = torch.stack([at(batch.target_probs, t + 1 + step) for t in range(length)], dim=1)
        positions = torch.arange(length).expand(size, -1) + step
        projections = draft.project_qkv(ids, hidden, positions)
        groups = TINY.num_attention_heads // TINY.num_key_value_heads
        all_keys.append(projections.keys.repeat_interleave(groups, 1))
        all_values.append(projections.values.repeat_interleave(groups, 1))
        keys, values = torch.cat(all_keys, dim=2), torch.cat(all_values, dim=2)   # [B, h, (step+1)T, d]
        allowed = torch.zeros(length, (step + 1) * length, dtype=torch.bool)
        for t in range(length):
            allowed[t, : t + 1] = True                                         # step-0 keys, causal
            for earlier in range(1, step + 1):
                allowed[t, earlier * length + t] = True                        # own position of steps 1..step
        scores = projections.queries @ keys.transpose(-1, -2) / TINY.head_dim ** 0.5
        attended = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ values
        hidden = draft.finish(hidden, attended)
        log_probs = torch.log_softmax(draft.logits(hidden), dim=-1)
        ploss = -(mask * (probs * log_probs).sum(-1)).sum() / (size * length)
        total = total + 0.8 ** step * ploss
    return total


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_ttt_loss_and_gradients_match_the_dense_reference(steps: int) -> None:
    draft, reference = tiny_draft(), tiny_draft()
    batch = random_batch()
    fast = ttt_forward(draft, batch, steps)
    slow = reference_ttt_loss(reference, batch, steps)
    assert torch.allclose(fast.loss, slow, atol=1e-6, rtol=1e-6), (fast.loss.item(), slow.item())
    fast.loss.backward()
    slow.backward()
    for (name, parameter), (_, expected) in zip(draft.named_parameters(), reference.named_parameters()):
        assert torch.allclose(parameter.grad, expected.grad, atol=1e-6, rtol=1e-5), name
    assert len(fast.acc) == steps and all(0.0 <= value <= 1.0 for value in fast.acc)


def test_attend_is_exact_with_large_scores() -> None:
    """The virtual-key merge stays exact when scores are large (no overflow, no lost precision)."""
    torch.manual_seed(3)
    queries = torch.randn(1, 2, 9, 8) * 6
    keys0, values0 = torch.randn(1, 1, 9, 8) * 6, torch.randn(1, 1, 9, 8)
    diagonal = [(torch.randn(1, 1, 9, 8) * 6, torch.randn(1, 1, 9, 8)) for _ in range(3)]
    fast = causal_plus_diagonal_attention(queries, keys0, values0, [k for k, _ in diagonal], [v for _, v in diagonal])
    keys = torch.cat([keys0] + [k for k, _ in diagonal], dim=2).repeat_interleave(2, 1)
    values = torch.cat([values0] + [v for _, v in diagonal], dim=2).repeat_interleave(2, 1)
    allowed = torch.zeros(9, 36, dtype=torch.bool)
    for t in range(9):
        allowed[t, : t + 1] = True
        allowed[t, [9 + t, 18 + t, 27 + t]] = True
    scores = (queries @ keys.transpose(-1, -2) / 8 ** 0.5).masked_fill(~allowed, float("-inf"))
    assert scores.max() > 30, "the test needs large scores"
    assert torch.allclose(fast, torch.softmax(scores, -1) @ values, atol=1e-5)


def test_metrics_and_simulated_accept_length() -> None:
    draft = tiny_draft()
    batch = random_batch()
    with torch.no_grad():
        output = ttt_forward(draft, batch, 3)
    metrics = output.metrics()
    expected = output.acc[0] + output.acc[0] * output.acc[1] + output.acc[0] * output.acc[1] * output.acc[2]
    assert metrics["simulated_accept_len"] == pytest.approx(expected)
    assert {"acc_0", "ploss_2", "expected_accept_1", "loss"} <= set(metrics)
    assert output.supervised[0] >= output.supervised[2], "deeper steps have fewer targets"


def test_a_draft_that_copies_the_teacher_is_fully_accepted() -> None:
    """acc counts draft top-1 (mapped through d2t) against the target top-1 over masked positions only."""
    draft = tiny_draft()
    batch = random_batch(length=6)
    with torch.no_grad():
        assert ttt_forward(draft, batch, 1).acc[0] < 1.0, "a random draft does not match a random teacher"
        ids = torch.cat([batch.input_ids[:, 1:], batch.input_ids[:, :1]], dim=1)
        _, logits = draft(batch.aux_hidden_state, ids)
    predicted = draft.draft_to_target(logits.argmax(-1))
    aligned = copy.copy(batch)
    aligned.target_top1 = torch.cat([predicted[:, :1], predicted], dim=1)[:, :6]
    aligned.target_top1_in_draft = torch.ones_like(batch.target_top1_in_draft)
    with torch.no_grad():
        assert ttt_forward(draft, aligned, 1).acc[0] == 1.0


def test_a_target_top1_outside_the_draft_vocab_is_a_miss() -> None:
    """An engine cannot accept a token its draft cannot propose: acc_k counts every supervised position, so a
    draft that matches the teacher wherever it can scores the in-draft share, not 1.0 (the loss still skips
    those positions, as SpecForge's does)."""
    draft = tiny_draft()
    batch = random_batch(length=6)
    with torch.no_grad():
        ids = torch.cat([batch.input_ids[:, 1:], batch.input_ids[:, :1]], dim=1)
        _, logits = draft(batch.aux_hidden_state, ids)
    predicted = draft.draft_to_target(logits.argmax(-1))
    aligned = copy.copy(batch)
    aligned.target_top1 = torch.cat([predicted[:, :1], predicted], dim=1)[:, :6]
    aligned.loss_mask = torch.ones_like(batch.loss_mask)
    aligned.target_top1_in_draft = torch.tensor([[True, True, False, True, False, True],
                                                 [True, False, True, True, True, True]])
    with torch.no_grad():
        output = ttt_forward(draft, aligned, 1)
    supervised = aligned.loss_mask[:, 1:].float()
    in_draft = supervised * aligned.target_top1_in_draft[:, 1:].float()
    assert output.supervised[0] == float(supervised.sum()) == 10.0
    assert output.scored[0] == float(in_draft.sum()) == 7.0
    assert output.acc[0] == pytest.approx(7.0 / 10.0)
