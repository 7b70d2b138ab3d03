"""The training-time-test loss equals a straightforward dense per-step reference, in values and gradients."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from models.eagle3 import Eagle3Config, Eagle3Draft
from models.teacher import Teacher, teacher_from_hidden
from models.ttt import (TTTBatch, TTTOutput, causal_plus_diagonal_attention, record_step_metrics, renormalised,
                        ttt_forward)
from tasks.common.devices import autocast
from attention_reference import assert_within_bf16, dense_causal_plus_diagonal

TINY = Eagle3Config(
    hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256, vocab_size=80, draft_vocab_size=50,
    target_hidden_size=32, aux_layer_ids=[1, 2, 3],
)


def tiny_draft(seed: int = 0, method: str = "eagle3") -> Eagle3Draft:
    torch.manual_seed(seed)
    config = TINY.for_method(method)
    if config.parallel_drafting:
        config.mask_token_id = TINY.vocab_size - 1
    draft = Eagle3Draft(config)
    for parameter in draft.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    draft.attach_embedding(torch.randn(TINY.vocab_size, TINY.hidden_size))
    used = torch.sort(torch.randperm(TINY.vocab_size)[: TINY.draft_vocab_size]).values
    t2d = torch.zeros(TINY.vocab_size, dtype=torch.bool)
    t2d[used] = True
    draft.set_vocab_mapping(used - torch.arange(TINY.draft_vocab_size), t2d)
    return draft


def random_batch(batch: int = 2, length: int = 12, seed: int = 1) -> TTTBatch:
    """Random features; the teacher keeps part of its mass outside the draft vocab, as a real one does."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, TINY.vocab_size, generator=generator) * 2
    mask = (torch.rand(batch, length, generator=generator) > 0.3).long()
    return TTTBatch(
        input_ids=torch.randint(0, TINY.vocab_size, (batch, length), generator=generator),
        loss_mask=mask,
        aux_hidden_state=torch.randn(batch, length, 3 * TINY.target_hidden_size, generator=generator),
        target_probs=torch.softmax(logits, dim=-1)[..., : TINY.draft_vocab_size],
        target_top1=torch.randint(0, TINY.vocab_size, (batch, length), generator=generator),
        target_top1_in_draft=torch.rand(batch, length, generator=generator) > 0.2,
    )


def reference_ttt_loss(draft: Eagle3Draft, batch: TTTBatch, steps: int) -> torch.Tensor:
    """docs/architecture.md §3 spelled out: per step, explicit shifts, a dense mask over all keys so far,
    the weighted loss against the teacher renormalised over the draft vocab."""
    size, length = batch.input_ids.shape

    def at(tensor: torch.Tensor, t: int, fill: float = 0.0) -> torch.Tensor:
        return tensor[:, t] if t < length else torch.full_like(tensor[:, 0], fill)

    weights = batch.loss_mask.float() * batch.target_top1_in_draft.float()
    aux = batch.aux_hidden_state
    if draft.config.fc_norm:  # EAGLE 3.1: each of the three aux states through its own RMSNorm before fc
        aux = torch.cat([norm(state) for norm, state in zip(draft.fc_norm, aux.chunk(3, dim=-1))], dim=-1)
    hidden = draft.fc(aux)
    all_keys, all_values = [], []
    total = torch.zeros(())
    for step in range(steps):
        ids = torch.stack([at(batch.input_ids, t + 1 + step) for t in range(length)], dim=1).long()
        if step > 0 and draft.config.parallel_drafting:  # P-EAGLE: later slots read the mask token and state
            ids = torch.full_like(ids, draft.config.mask_token_id)
            hidden = draft.fc(draft.mask_hidden).expand(size, length, -1)
        mask = torch.stack([at(weights, t + 1 + step) for t in range(length)], dim=1)
        probs = torch.stack([at(batch.target_probs, t + 1 + step) for t in range(length)], dim=1)
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)
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
        h_out = draft.finish(hidden, attended)
        log_probs = torch.log_softmax(draft.logits(h_out), dim=-1)
        hidden = draft.norm(h_out) if draft.config.norm_output else h_out  # EAGLE 3.1 carries the normed output
        ploss = -(mask * (probs * log_probs).sum(-1)).sum() / (size * length)
        total = total + 0.8 ** step * ploss
    return total


@pytest.mark.parametrize("steps, method", [(1, "eagle3"), (3, "eagle3"), (7, "eagle3"), (3, "eagle3.1"),
                                           (3, "peagle")])
def test_ttt_loss_and_gradients_match_the_dense_reference(steps: int, method: str) -> None:
    draft, reference = tiny_draft(method=method), tiny_draft(method=method)
    batch = random_batch()
    fast = ttt_forward(draft, batch, steps)
    slow = reference_ttt_loss(reference, batch, steps)
    assert torch.allclose(fast.loss, slow, atol=1e-6, rtol=1e-6), (fast.loss.item(), slow.item())
    fast.loss.backward()
    slow.backward()
    for (name, parameter), (_, expected) in zip(draft.named_parameters(), reference.named_parameters()):
        assert torch.allclose(parameter.grad, expected.grad, atol=1e-6, rtol=1e-5), name
    assert len(fast.acc) == steps and all(0.0 <= value <= 1.0 for value in fast.acc)


@pytest.mark.integration  # inductor builds its CPU kernels with a C++ compiler in subprocesses
def test_compiled_dense_parts_give_the_eager_loss_and_gradients() -> None:
    """training.compile's step (models/ttt_compile.py) over two batch shapes, as a run meets them, equals eager."""
    from models.ttt_compile import compile_draft_parts

    eager, compiled = tiny_draft(method="eagle3.1"), tiny_draft(method="eagle3.1")
    loss_fn = compile_draft_parts(compiled)
    assert compiled.state_dict().keys() == eager.state_dict().keys(), "compiling leaves the checkpoint's tensors as they are"
    for length, seed in ((12, 1), (20, 2)):
        batch = random_batch(length=length, seed=seed)
        for draft in (eager, compiled):
            draft.zero_grad()
        slow = ttt_forward(eager, batch, 3)
        fast = ttt_forward(compiled, batch, 3, loss_fn=loss_fn)
        assert torch.allclose(fast.loss, slow.loss, atol=1e-5, rtol=1e-5), (fast.loss.item(), slow.loss.item())
        assert fast.acc == slow.acc
        slow.loss.backward()
        fast.loss.backward()
        for (name, parameter), (_, expected) in zip(compiled.named_parameters(), eager.named_parameters()):
            assert torch.allclose(parameter.grad, expected.grad, atol=1e-5, rtol=1e-4), (length, name)


def attention_inputs(seed: int, shape: tuple[int, int, int, int, int], diagonals: int, magnitude: float,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """(queries, keys0, values0, diagonal keys, diagonal values) for `shape` = (B, heads, kv heads, T, d);
    queries and keys scaled by `magnitude`, values standard normal. Magnitude 6 gives scores of std 36: large
    scores are where a merge loses precision."""
    batch, heads, kv_heads, length, dim = shape
    generator = torch.Generator().manual_seed(seed)

    def draw(count: int, scale: float) -> torch.Tensor:
        return (torch.randn(batch, count, length, dim, generator=generator) * scale).to(dtype)

    queries, keys0, values0 = draw(heads, magnitude), draw(kv_heads, magnitude), draw(kv_heads, 1.0)
    keys = [draw(kv_heads, magnitude) for _ in range(diagonals)]
    values = [draw(kv_heads, 1.0) for _ in range(diagonals)]
    return queries, keys0, values0, keys, values


def test_attend_is_exact_with_large_scores() -> None:
    """The virtual-key merge stays exact when scores are large (no overflow, no lost precision)."""
    inputs = attention_inputs(3, (1, 2, 1, 9, 8), diagonals=3, magnitude=6.0)
    fast = causal_plus_diagonal_attention(*inputs)
    assert torch.allclose(fast, dense_causal_plus_diagonal(*inputs), atol=1e-5)


@pytest.mark.parametrize("inputs_dtype", [torch.bfloat16, torch.float32])
def test_bf16_autocast_attention_matches_the_dense_softmax(inputs_dtype: torch.dtype) -> None:
    """training.precision bf16 (CPU autocast here, as on GPU): with large scores, the merge must use the
    virtual key's score as the kernel saw it (rounded to bf16) and diagonal scores as exact as the kernel's
    own; the unrounded peak or bf16 diagonal scores are off by several percent."""
    inputs = attention_inputs(5, (2, 4, 2, 33, 64), diagonals=3, magnitude=6.0, dtype=inputs_dtype)
    with autocast(torch.device("cpu"), torch.bfloat16):
        fast = causal_plus_diagonal_attention(*inputs)
    assert_within_bf16(fast, *inputs)


def fake_flash_attn_func(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, softmax_scale: float,
                         causal: bool) -> torch.Tensor:
    """flash_attn's interface ([B, T, h, d], bf16 in and out, fp32 scores) over SDPA, for CPUs."""
    assert queries.dtype == torch.bfloat16 and causal
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         is_causal=True, scale=softmax_scale)
    return out.transpose(1, 2)


def test_flash_attn_backend_merges_with_the_peak_it_rounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 queries into flash_attn are cast to bf16 inside `causal_attention`: the merge must still use the
    peak as that cast left it."""
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=fake_flash_attn_func))
    inputs = attention_inputs(7, (2, 4, 2, 33, 64), diagonals=3, magnitude=6.0)
    fast = causal_plus_diagonal_attention(*inputs, backend="flash_attn")
    assert fast.dtype == torch.float32
    assert_within_bf16(fast, *inputs)


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
    """An engine cannot accept a token its draft cannot propose: acc_k and expected acceptance count every
    supervised position, so a draft that matches the teacher wherever it can scores the in-draft share, not
    1.0 (the loss still skips those positions, as SpecForge's does)."""
    draft = tiny_draft()
    batch = random_batch(length=6)
    with torch.no_grad():
        ids = torch.cat([batch.input_ids[:, 1:], batch.input_ids[:, :1]], dim=1)
        _, logits = draft(batch.aux_hidden_state, ids)
    predicted = draft.draft_to_target(logits.argmax(-1))
    outside = torch.tensor([[False, False, True, False, True, False],
                            [False, True, False, False, False, False]])    # rows whose top-1 the draft lacks
    aligned = copy.copy(batch)
    aligned.loss_mask = torch.ones_like(batch.loss_mask)
    aligned.target_top1 = torch.cat([predicted[:, :1], predicted], dim=1)[:, :6]
    aligned.target_top1[outside] = int(torch.nonzero(~draft.t2d)[0])
    aligned.target_top1_in_draft = draft.t2d[aligned.target_top1]
    with torch.no_grad():
        output = ttt_forward(draft, aligned, 1)
    assert output.supervised[0] == 10.0, "position t learns row t + 1: rows 1..5 of both records"
    assert output.acc[0] == pytest.approx(7.0 / 10.0)
    overlap = torch.minimum(torch.softmax(logits[:, :5], dim=-1), aligned.target_probs[:, 1:]).sum(-1)
    assert output.expected_accept[0] == pytest.approx(float(overlap.mean()), rel=1e-6)


def test_expected_acceptance_counts_the_target_mass_outside_the_draft_vocab_as_rejected() -> None:
    """Speculative sampling accepts a draft token v with min(1, p(v) / q(v)), so a position accepts with
    sum_v min(q(v), p(v)), p the target's full-vocab probabilities. By hand: q = (.5, .5) against
    p = (.3, .1) with 0.6 outside the draft vocab accepts 0.4; q = (0, 0, 1) against p = (0, 0, .9) accepts
    0.9: 0.65 over both, where the teacher renormalised over the draft vocab would claim (0.75 + 1) / 2."""
    draft = tiny_draft()
    draft_probs = torch.zeros(2, TINY.draft_vocab_size)
    draft_probs[0, :2] = 0.5
    draft_probs[1, 2] = 1.0
    target_probs = torch.zeros(2, TINY.draft_vocab_size)
    target_probs[0, :2] = torch.tensor([0.3, 0.1])
    target_probs[1, 2] = 0.9
    outside_the_draft_vocab = int(torch.nonzero(~draft.t2d)[0])
    target_top1 = torch.cat([torch.tensor([outside_the_draft_vocab]), draft.draft_to_target(torch.tensor([2]))])
    honest, inflated = TTTOutput(loss=torch.zeros(())), TTTOutput(loss=torch.zeros(()))
    record_step_metrics(honest, draft, draft_probs.log(), target_probs, target_top1)
    record_step_metrics(inflated, draft, draft_probs.log(), renormalised(target_probs), target_top1)
    assert honest.expected_accept[0] == pytest.approx(0.65)
    assert inflated.expected_accept[0] == pytest.approx(0.875), "renormalising would inflate it"
    assert honest.acc == [0.5] and honest.supervised == [2.0], "the first top-1 lies outside the draft vocab"


def test_the_teacher_keeps_the_target_mass_outside_the_draft_vocab() -> None:
    """teacher_from_hidden gives full-vocab probabilities of the draft tokens; the loss's renormalised
    teacher is the softmax over the draft vocab's logits."""
    generator = torch.Generator().manual_seed(2)
    hidden, lm_head = torch.randn(5, 32, generator=generator), torch.randn(TINY.vocab_size, 32, generator=generator)
    t2d = tiny_draft().t2d
    probs, top1, in_draft = teacher_from_hidden(hidden, lm_head, t2d)
    logits = hidden @ lm_head.T
    assert torch.allclose(probs.sum(-1), torch.softmax(logits, -1)[:, t2d].sum(-1)) and bool((probs.sum(-1) < 1).all())
    assert torch.allclose(renormalised(probs), torch.softmax(logits[:, t2d], -1), atol=1e-6)
    assert torch.equal(top1, logits.argmax(-1)) and torch.equal(in_draft, t2d[top1])


def test_eval_metrics_pool_every_supervised_position_of_every_record() -> None:
    """tasks/train.py's eval (whose simulated_accept_len picks checkpoints/best.json) weighs each record by its
    supervised positions: over records one at a time it equals one padded batch of them all."""
    from tasks.features.batches import collate
    from tasks.train import evaluate_features

    draft, generator = tiny_draft(), torch.Generator().manual_seed(4)
    lm_head = torch.randn(TINY.vocab_size, TINY.target_hidden_size, generator=generator) * 3
    records = []
    for length, supervised_from in [(9, 2), (14, 8)]:
        records.append({"input_ids": torch.randint(0, TINY.vocab_size, (length,), generator=generator),
                        "loss_mask": (torch.arange(length) >= supervised_from).long(),
                        "aux_hidden_state": torch.randn(length, 3 * TINY.target_hidden_size, generator=generator),
                        "hidden_state": torch.randn(length, TINY.target_hidden_size, generator=generator)})
    teacher = Teacher(lm_head, draft.t2d)
    metrics = evaluate_features(draft, records, teacher, steps=2)
    with torch.no_grad():
        pooled = ttt_forward(draft, collate(records, teacher), 2)
    for step in range(2):
        assert metrics[f"acc_{step}"] == pytest.approx(pooled.acc[step])
        assert metrics[f"expected_accept_{step}"] == pytest.approx(pooled.expected_accept[step], rel=1e-5)
    assert metrics["simulated_accept_len"] == pytest.approx(pooled.simulated_accept_len)
    assert 0.0 < pooled.expected_accept[0] < 1.0


def test_eval_with_a_settled_cache_equals_eval_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's evaluations keep what the teacher settled per eval record (top-1, full-vocabulary
    log-sum-exp): the second evaluation skips the full-vocabulary pass and reports the same metrics."""
    from tasks.features.batches import SettledCache
    from tasks.train import evaluate_features

    draft, generator = tiny_draft(), torch.Generator().manual_seed(5)
    lm_head = torch.randn(TINY.vocab_size, TINY.target_hidden_size, generator=generator) * 3
    records = [{"input_ids": torch.randint(0, TINY.vocab_size, (length,), generator=generator),
                "loss_mask": torch.ones(length, dtype=torch.long),
                "aux_hidden_state": torch.randn(length, 3 * TINY.target_hidden_size, generator=generator),
                "hidden_state": torch.randn(length, TINY.target_hidden_size, generator=generator)}
               for length in (11, 6, 17)]
    teacher, cache = Teacher(lm_head, draft.t2d), SettledCache()
    plain = evaluate_features(draft, records, teacher, steps=2)
    first = evaluate_features(draft, records, teacher, steps=2, cache=cache)
    assert sorted(cache.settled) == [0, 1, 2] and cache.settled[2].log_normaliser.shape == (17,)
    monkeypatch.setattr(teacher, "full_pass", lambda *_: pytest.fail("the settled values were not reused"))
    second = evaluate_features(draft, records, teacher, steps=2, cache=cache)
    assert plain == first == second
