"""The training-time test (TTT): L unrolled draft steps, their attention, loss and metrics (docs/architecture.md §3).

Features arrive token-aligned (row t: token x_t, its loss mask, the target's states after x_0..x_t).
The EAGLE3 shift happens here: at step k, position t reads the hidden `fc(aux[t])` (k = 0) or the step k-1
output, the embedding of x_{t+1+k}, RoPE position t + k, and learns the target's distribution at t+1+k
(the next token after x_{t+1+k}), weighted by the token mask of x_{t+1+k}; past the end the weight is 0.

P-EAGLE (`parallel_drafting`) trains the same slots with the same attention and targets, but at step k >= 1 every
position reads the mask token and fc(mask_hidden) instead of x_{t+1+k} and the step k-1 output: vLLM drafts its k
tokens in one pass over exactly these inputs.

Attention at step k: query t sees the step-0 keys 0..t causally, plus from every step j = 1..k only its own
position t. The causal part runs as one fused scaled-dot-product call (no T x T matrix is built); the
diagonal terms join it exactly through one extra "virtual" key whose score is chosen per query, so the
fused call also returns each query's causal softmax mass (see `causal_plus_diagonal_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from models.eagle3 import Eagle3Draft
from models.shape_buckets import pad_rows, shape_bucket


@dataclass
class TTTBatch:
    """Right-padded, token-aligned features of B records (padding has loss_mask 0)."""

    input_ids: torch.Tensor          # [B, T] int64
    loss_mask: torch.Tensor          # [B, T] token mask (1 on supervised tokens)
    aux_hidden_state: torch.Tensor   # [B, T, 3H]
    target_probs: torch.Tensor       # [B, T, Vd] the target's full-vocab probabilities at t of the draft tokens
    target_top1: torch.Tensor        # [B, T] full-vocab argmax of the target at t
    target_top1_in_draft: torch.Tensor  # [B, T] bool


def simulated_accept_length(accuracies: list[float]) -> float:
    """sum_k prod_{j<=k} acc_j: the expected accepted length of a chain draft of len(accuracies) steps."""
    total, running = 0.0, 1.0
    for accuracy in accuracies:
        running *= accuracy
        total += running
    return total


@dataclass
class TTTOutput:
    loss: torch.Tensor
    ploss: list[torch.Tensor] = field(default_factory=list)
    acc: list[float] = field(default_factory=list)
    expected_accept: list[float] = field(default_factory=list)
    supervised: list[float] = field(default_factory=list)  # every supervised position: the metrics' denominator

    @property
    def simulated_accept_len(self) -> float:
        return simulated_accept_length(self.acc)

    def metrics(self) -> dict[str, float]:
        values = {"loss": float(self.loss.detach()), "simulated_accept_len": self.simulated_accept_len}
        for step, (ploss, acc) in enumerate(zip(self.ploss, self.acc)):
            values.update({f"ploss_{step}": float(ploss.detach()), f"acc_{step}": acc})
        for step, accept in enumerate(self.expected_accept):
            values[f"expected_accept_{step}"] = accept
        return values


def renormalised(probs: torch.Tensor) -> torch.Tensor:
    """Rows of target probabilities over the draft vocab rescaled to sum to 1: the distribution the loss
    teaches (as SpecForge). A row without mass stays zero."""
    return probs / probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)


def shift_left(x: torch.Tensor, steps: int, fill: float | int = 0) -> torch.Tensor:
    """x[:, t + steps] at t, `fill` past the end (works for [B, T] and [B, T, D])."""
    if steps == 0:
        return x
    shifted = torch.full_like(x, fill)
    shifted[:, :-steps] = x[:, steps:]
    return shifted


ATTENTION_BACKENDS = ("sdpa", "flash_attn")


def check_attention_backend(backend: str) -> None:
    """Fail before training starts when the configured backend cannot run here."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"training.attention_backend {backend!r}: expected one of {ATTENTION_BACKENDS}")
    if backend == "sdpa":
        return
    if not torch.cuda.is_available():
        raise ValueError("training.attention_backend 'flash_attn' needs a CUDA GPU; use 'sdpa' on CPU")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        raise ValueError("training.attention_backend 'flash_attn' needs the flash-attn package: "
                         "pip install 'eaglet[cuda]' (or use 'sdpa')") from None


def kernel_dtype(queries: torch.Tensor, backend: str) -> torch.dtype:
    """The dtype `causal_attention` computes in for these queries: flash_attn takes bf16/fp16 only, and
    sdpa is an autocast op (under autocast it runs in the autocast dtype, whatever its inputs)."""
    if backend == "flash_attn":
        return torch.bfloat16 if queries.dtype == torch.float32 else queries.dtype
    device = queries.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return queries.dtype


def causal_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                     backend: str = "sdpa") -> torch.Tensor:
    """Plain causal attention over [B, h, T, d] tensors with equal head counts, by the chosen kernel.

    flash_attn takes [B, T, h, d] in bf16/fp16; its result is cast back so the merge in
    `causal_plus_diagonal_attention` runs in the queries' dtype. Only the output is used (never flash's
    log-sum-exp, which carries no gradient)."""
    if backend == "sdpa":
        return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
    from flash_attn import flash_attn_func

    half = kernel_dtype(queries, backend)
    out = flash_attn_func(queries.transpose(1, 2).to(half), keys.transpose(1, 2).to(half),
                          values.transpose(1, 2).to(half), softmax_scale=scale, causal=True)
    return out.transpose(1, 2).to(queries.dtype)


def causal_plus_diagonal_attention(queries: torch.Tensor, keys0: torch.Tensor, values0: torch.Tensor,
                                   diagonal_keys: list[torch.Tensor], diagonal_values: list[torch.Tensor],
                                   backend: str = "sdpa") -> torch.Tensor:
    """Causal attention over the step-0 keys plus, for each query t, the diagonal keys at t (exact).

    With Z = sum of exp(causal scores) and O the causal attention output, the answer is
    (Z O + sum_j e^{s_j} V_j) / (Z + sum_j e^{s_j}). One fused causal call over a sequence that starts with a
    virtual key (score m_t = max_j s_j, chosen per query through one extra query channel) yields
    Z O / D, Z / D and e^{m_t} / D with D = e^{m_t} + Z, which is all the merge needs. The trick needs no
    mask, so any causal kernel (`backend`) runs it, and gradients flow through its outputs only.
    Under bf16 the diagonal scores and the merge run in fp32, as the kernel's own scores and softmax do: the
    result differs from an fp32 attention over the same bf16 inputs by the rounding of the kernel's outputs.
    """
    groups = queries.shape[1] // keys0.shape[1]
    keys0 = keys0.repeat_interleave(groups, 1)
    values0 = values0.repeat_interleave(groups, 1)
    dim = queries.shape[-1]
    scale = dim ** -0.5
    if not diagonal_keys:
        return causal_attention(queries, keys0, values0, scale, backend)
    computed_in = kernel_dtype(queries, backend)
    scores = diagonal_scores(queries, diagonal_keys, scale, computed_in)                  # [k, B, h, T] fp32
    channel, peak = virtual_key_channel(scores, scale, computed_in)
    extra = (-(dim + 2)) % 8 + 2                                                          # 2 channels, padded to x8
    batch, heads, length, _ = queries.shape
    zeros = queries.new_zeros(batch, heads, length, extra)

    q_aug = torch.cat([queries, zeros], dim=-1)
    q_aug[..., dim] = channel
    k_aug = torch.cat([keys0, zeros], dim=-1)
    v_aug = torch.cat([values0, zeros], dim=-1)
    v_aug[..., dim + 1] = 1.0                                    # real keys' share of the softmax: Z / D
    virtual_q = queries.new_zeros(batch, heads, 1, dim + extra)
    virtual_k = virtual_q.clone()
    virtual_k[..., dim] = 1.0                                    # score q_aug . k* = m_t
    virtual_v = virtual_q.clone()
    virtual_v[..., dim] = 1.0                                    # the virtual key's share: e^{m_t} / D
    out = causal_attention(torch.cat([virtual_q, q_aug], dim=2), torch.cat([virtual_k, k_aug], dim=2),
                           torch.cat([virtual_v, v_aug], dim=2), scale, backend)[:, :, 1:].float()
    causal_part, virtual_share, real_share = out[..., :dim], out[..., dim:dim + 1], out[..., dim + 1:dim + 2]
    weights = torch.exp(scores - peak)                                                    # e^{s_j - m_t}
    numerator = causal_part + virtual_share * weighted_diagonal_values(weights, diagonal_values)
    denominator = real_share + virtual_share * weights.sum(0).unsqueeze(-1)
    return (numerator / denominator).to(queries.dtype)


def by_kv_head(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, h, T, ...] -> [B, kv_heads, h / kv_heads, T, ...]: query heads grouped by the kv head they share
    (the order repeat_interleave expands), so a kv tensor broadcasts over its group without a copy per head."""
    return x.reshape(x.shape[0], kv_heads, -1, *x.shape[2:])


def diagonal_scores(queries: torch.Tensor, diagonal_keys: list[torch.Tensor], scale: float,
                    dtype: torch.dtype) -> torch.Tensor:
    """s_j = q_t . k_j,t * scale [k, B, h, T], as the kernel scores its keys: inputs in its `dtype`, products
    and sums in fp32. Left in bf16, a score of ~100 would be off by up to 0.25 and its weight by ~30%."""
    grouped = by_kv_head(queries.to(dtype).float(), diagonal_keys[0].shape[1])
    scores = [(grouped * key.to(dtype).float().unsqueeze(2)).sum(-1).flatten(1, 2) for key in diagonal_keys]
    return torch.stack(scores) * scale


def virtual_key_channel(scores: torch.Tensor, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the virtual key's query channel, the score m_t the kernel gives it) from diagonal scores [k, B, h, T].

    The kernel scores the virtual key as channel * scale (in fp32), with the channel rounded to the dtype it
    computes in (bf16: up to 2^-8 relative, ~0.1 at a peak of 30). m_t is read back from that rounded
    channel, so the merge's e^{s_j - m_t} divides out exactly the e^{m_t} the kernel added; the unrounded
    peak would skew every diagonal weight by e^{rounding error}. (Keeping the virtual key in fp32 instead
    would need an fp32 attention call; this costs one cast.)"""
    peak = scores.max(dim=0).values.detach()
    channel = (peak / scale).to(dtype)
    return channel, channel.float() * scale


def weighted_diagonal_values(weights: torch.Tensor, diagonal_values: list[torch.Tensor]) -> torch.Tensor:
    """sum_j weights[j] * V_j [B, h, T, d] in fp32, with V_j [B, kv_heads, T, d] in any dtype (not copied
    to fp32 nor per query head: the product promotes and broadcasts)."""
    kv_heads = diagonal_values[0].shape[1]
    total = sum(by_kv_head(weight.unsqueeze(-1), kv_heads) * value.unsqueeze(2)
                for weight, value in zip(weights, diagonal_values))
    return total.flatten(1, 2)


def step_loss(logits: torch.Tensor, target_probs: torch.Tensor, draft_mass: torch.Tensor, mask: torch.Tensor,
              normaliser: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ploss = -(1/(B*T)) * sum_t mask[t] * sum_v p'[t,v] * log_softmax(logits[t])[v] (normaliser = B*T), with p' the
    teacher renormalised over the draft vocab: p / its draft mass, divided per position rather than per element."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    per_position = (target_probs * log_probs).sum(-1) / draft_mass
    return -(mask * per_position).sum() / normaliser, log_probs


def draft_mass(probs: torch.Tensor) -> torch.Tensor:
    """Each row's teacher mass on the draft vocab (what `renormalised` divides by)."""
    return probs.sum(dim=-1).clamp_min(torch.finfo(probs.dtype).tiny)


def ttt_forward(draft: Eagle3Draft, batch: TTTBatch, steps: int, decay: float = 0.8,
                positions: Optional[torch.Tensor] = None, normaliser: Optional[int] = None,
                attention_backend: str = "sdpa", expected_acceptance: bool = True,
                loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = step_loss) -> TTTOutput:
    """Unroll `steps` draft steps with teacher forcing; loss = sum_k decay**k * ploss_k.

    `normaliser` is the B*T of the formula; by default the batch's padded size. A data-parallel step
    passes the global batch's token count so every rank's share adds up to the same loss. Without
    `expected_acceptance` (training steps, which log only loss and accuracy) that metric is not computed.
    `loss_fn` is `step_loss`, or its compiled form (models/ttt_compile.py)."""
    size, length = batch.input_ids.shape
    if positions is None:
        positions = torch.arange(length, device=batch.input_ids.device).expand(size, -1)
    # The EAGLE3 shift: position t reads x_{t+1}, learns the target at t+1, weighted by x_{t+1}'s mask.
    ids = shift_left(batch.input_ids, 1)
    # The loss (as SpecForge) only where the target's top-1 is in the draft vocab; the metrics over every
    # supervised position, since an engine cannot accept a token its draft cannot propose.
    supervised = shift_left(batch.loss_mask.float(), 1)
    mask = supervised * shift_left(batch.target_top1_in_draft.float(), 1)
    # The teacher's rows are gathered per step where they are used, not shifted whole ([B, T, Vd] per step).
    teacher_rows = batch.target_probs.reshape(size * length, -1)
    teacher_mass = draft_mass(teacher_rows)
    teacher_top1 = batch.target_top1.reshape(-1)

    hidden = draft.project(batch.aux_hidden_state)
    keys0 = values0 = None
    diagonal_keys: list[torch.Tensor] = []
    diagonal_values: list[torch.Tensor] = []
    output = TTTOutput(loss=hidden.new_zeros(()))
    for step in range(steps):
        step_ids, step_supervised = shift_left(ids, step), shift_left(supervised, step)
        if step > 0 and draft.config.parallel_drafting:  # P-EAGLE: slot k reads the mask, not slot k-1's guess
            step_ids, hidden = draft.mask_inputs(ids)
        projections = draft.project_qkv(step_ids, hidden, positions + step)
        if step == 0:
            keys0, values0 = projections.keys, projections.values
        else:
            diagonal_keys.append(projections.keys)
            diagonal_values.append(projections.values)
        attended = causal_plus_diagonal_attention(projections.queries, keys0, values0, diagonal_keys, diagonal_values,
                                                  attention_backend)
        h_out = draft.finish(hidden, attended)
        # Logits only at supervised positions: the lm_head dominates the cost, and unsupervised positions
        # (prompts, padding, past the end) add nothing to the loss or the metrics.
        chosen = step_supervised > 0
        rows = teacher_row_index(chosen, step)
        step_probs = teacher_rows.index_select(0, rows)
        logits = supervised_logits(draft, h_out, chosen)
        hidden = draft.carry(h_out)
        ploss, log_probs = loss_fn(logits, step_probs, teacher_mass[rows], shift_left(mask, step)[chosen],
                                   normaliser=normaliser or mask.numel())
        output.loss = output.loss + decay ** step * ploss
        output.ploss.append(ploss)
        record_step_metrics(output, draft, log_probs, step_probs if expected_acceptance else None, teacher_top1[rows])
    return output


def supervised_logits(draft: Eagle3Draft, hidden: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The draft's logits at the chosen positions, computed over their rows padded to a shape bucket (their count
    changes every step; models/shape_buckets.py) and cut back to them."""
    rows = hidden[chosen]
    return draft.logits(pad_rows(rows, shape_bucket(rows.dtype)))[:rows.shape[0]]


def teacher_row_index(chosen: torch.Tensor, step: int) -> torch.Tensor:
    """Flat [B*T] row of the teacher each chosen position (b, t) of step `step` learns: token t + 1 + step of
    record b (in range: a chosen position is supervised, so that token exists), in the order `x[chosen]` takes."""
    batch_rows, positions = chosen.nonzero(as_tuple=True)
    return batch_rows * chosen.shape[1] + positions + 1 + step


def record_step_metrics(output: TTTOutput, draft: Eagle3Draft, log_probs: torch.Tensor,
                        target_probs: Optional[torch.Tensor], target_top1: torch.Tensor) -> None:
    """Both over every supervised position of the step (the rows given), as an engine sees them.

    acc_k: draft top-1 (mapped to the target vocab) == target top-1; a target top-1 outside the draft vocab
    is a miss, since the draft cannot propose it. expected_accept_k (when `target_probs` are given): the chance
    that speculative sampling accepts the draft's sampled token, sum_v q(v) min(1, p(v) / q(v)) = sum_v min(q(v), p(v)),
    with p the target's full-vocab probabilities (not renormalised: its mass outside the draft vocab is never
    accepted)."""
    supervised = float(log_probs.shape[0])
    with torch.no_grad():
        draft_top1 = draft.draft_to_target(log_probs.argmax(dim=-1))
        correct = float((draft_top1 == target_top1).sum())
        output.acc.append(correct / supervised if supervised else 0.0)
        if target_probs is not None:
            accepted = float(torch.minimum(log_probs.exp(), target_probs).sum())
            output.expected_accept.append(accepted / supervised if supervised else 0.0)
    output.supervised.append(supervised)
