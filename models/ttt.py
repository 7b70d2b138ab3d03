"""The training-time test (TTT): L unrolled draft steps, their attention, loss and metrics (docs/architecture.md §3).

Features arrive token-aligned (row t: token x_t, its loss mask, the target's states after x_0..x_t).
The EAGLE3 shift happens here: at step k, position t reads the hidden `fc(aux[t])` (k = 0) or the step k-1
output, the embedding of x_{t+1+k}, RoPE position t + k, and learns the target's distribution at t+1+k
(the next token after x_{t+1+k}), weighted by the token mask of x_{t+1+k}; past the end the weight is 0.

Attention at step k: query t sees the step-0 keys 0..t causally, plus from every step j = 1..k only its own
position t. The causal part runs as one fused scaled-dot-product call (no T x T matrix is built); the
diagonal terms join it exactly through one extra "virtual" key whose score is chosen per query, so the
fused call also returns each query's causal softmax mass (see `causal_plus_diagonal_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from models.eagle3 import Eagle3Draft


@dataclass
class TTTBatch:
    """Right-padded, token-aligned features of B records (padding has loss_mask 0)."""

    input_ids: torch.Tensor          # [B, T] int64
    loss_mask: torch.Tensor          # [B, T] token mask (1 on supervised tokens)
    aux_hidden_state: torch.Tensor   # [B, T, 3H]
    target_probs: torch.Tensor       # [B, T, Vd] target distribution at t over the draft vocab
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
    supervised: list[float] = field(default_factory=list)  # every supervised position: acc_k's denominator
    scored: list[float] = field(default_factory=list)  # those whose target top-1 is in the draft vocab

    @property
    def simulated_accept_len(self) -> float:
        return simulated_accept_length(self.acc)

    def metrics(self) -> dict[str, float]:
        values = {"loss": float(self.loss.detach()), "simulated_accept_len": self.simulated_accept_len}
        for step, (ploss, acc, accept) in enumerate(zip(self.ploss, self.acc, self.expected_accept)):
            values.update({f"ploss_{step}": float(ploss.detach()), f"acc_{step}": acc, f"expected_accept_{step}": accept})
        return values


def teacher_from_hidden(hidden_state: torch.Tensor, lm_head_weight: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target_probs over draft vocab, full-vocab top-1, top-1 in draft vocab) from final normed states."""
    with torch.no_grad():
        logits = hidden_state.float() @ lm_head_weight.float().T
        top1 = logits.argmax(dim=-1)
        probs = torch.softmax(logits[..., t2d], dim=-1)
    return probs, top1, t2d[top1]


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


def causal_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                     backend: str = "sdpa") -> torch.Tensor:
    """Plain causal attention over [B, h, T, d] tensors with equal head counts, by the chosen kernel.

    flash_attn takes [B, T, h, d] in bf16/fp16; its result is cast back so the merge in
    `causal_plus_diagonal_attention` runs in the queries' dtype. Only the output is used (never flash's
    log-sum-exp, which carries no gradient)."""
    if backend == "sdpa":
        return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
    from flash_attn import flash_attn_func

    half = torch.bfloat16 if queries.dtype == torch.float32 else queries.dtype
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
    """
    groups = queries.shape[1] // keys0.shape[1]
    keys0 = keys0.repeat_interleave(groups, 1)
    values0 = values0.repeat_interleave(groups, 1)
    dim = queries.shape[-1]
    scale = dim ** -0.5
    if not diagonal_keys:
        return causal_attention(queries, keys0, values0, scale, backend)
    diag_k = torch.stack([key.repeat_interleave(groups, 1) for key in diagonal_keys])      # [k, B, h, T, d]
    diag_v = torch.stack([value.repeat_interleave(groups, 1) for value in diagonal_values])
    scores = (queries.unsqueeze(0) * diag_k).sum(-1) * scale                              # [k, B, h, T]
    peak = scores.max(dim=0).values.detach()                                              # m_t
    extra = (-(dim + 2)) % 8 + 2                                                          # 2 channels, padded to x8
    batch, heads, length, _ = queries.shape
    zeros = queries.new_zeros(batch, heads, length, extra)

    q_aug = torch.cat([queries, zeros], dim=-1)
    q_aug[..., dim] = peak / scale
    k_aug = torch.cat([keys0, zeros], dim=-1)
    v_aug = torch.cat([values0, zeros], dim=-1)
    v_aug[..., dim + 1] = 1.0                                    # real keys' share of the softmax: Z / D
    virtual_q = queries.new_zeros(batch, heads, 1, dim + extra)
    virtual_k = virtual_q.clone()
    virtual_k[..., dim] = 1.0                                    # score q_aug . k* = m_t
    virtual_v = virtual_q.clone()
    virtual_v[..., dim] = 1.0                                    # the virtual key's share: e^{m_t} / D
    out = causal_attention(torch.cat([virtual_q, q_aug], dim=2), torch.cat([virtual_k, k_aug], dim=2),
                           torch.cat([virtual_v, v_aug], dim=2), scale, backend)[:, :, 1:]
    causal_part, virtual_share, real_share = out[..., :dim], out[..., dim:dim + 1], out[..., dim + 1:dim + 2]
    weights = torch.exp(scores - peak).unsqueeze(-1)                                      # e^{s_j - m_t}
    numerator = causal_part + virtual_share * (weights * diag_v).sum(0)
    denominator = real_share + virtual_share * weights.sum(0)
    return numerator / denominator


def step_loss(logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor,
              normaliser: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ploss = -(1/(B*T)) * sum_t mask[t] * sum_v p[t,v] * log_softmax(logits[t])[v] (normaliser = B*T)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    per_position = (target_probs * log_probs).sum(-1)
    return -(mask * per_position).sum() / normaliser, log_probs


def ttt_forward(draft: Eagle3Draft, batch: TTTBatch, steps: int, decay: float = 0.8,
                positions: Optional[torch.Tensor] = None, normaliser: Optional[int] = None,
                attention_backend: str = "sdpa") -> TTTOutput:
    """Unroll `steps` draft steps with teacher forcing; loss = sum_k decay**k * ploss_k.

    `normaliser` is the B*T of the formula; by default the batch's padded size. A data-parallel step
    passes the global batch's token count so every rank's share adds up to the same loss."""
    size, length = batch.input_ids.shape
    if positions is None:
        positions = torch.arange(length, device=batch.input_ids.device).expand(size, -1)
    # The EAGLE3 shift: position t reads x_{t+1}, learns the target at t+1, weighted by x_{t+1}'s mask.
    ids = shift_left(batch.input_ids, 1)
    # The loss (as SpecForge) only where the target's top-1 is in the draft vocab; acc_k over every supervised
    # position, since an engine cannot accept a token its draft cannot propose.
    supervised = shift_left(batch.loss_mask.float(), 1)
    mask = supervised * shift_left(batch.target_top1_in_draft.float(), 1)
    probs = shift_left(batch.target_probs, 1)
    top1 = shift_left(batch.target_top1, 1)

    hidden = draft.project(batch.aux_hidden_state)
    keys0 = values0 = None
    diagonal_keys: list[torch.Tensor] = []
    diagonal_values: list[torch.Tensor] = []
    output = TTTOutput(loss=hidden.new_zeros(()))
    for step in range(steps):
        step_ids, step_mask = shift_left(ids, step), shift_left(mask, step)
        step_probs, step_top1 = shift_left(probs, step), shift_left(top1, step)
        projections = draft.project_qkv(step_ids, hidden, positions + step)
        if step == 0:
            keys0, values0 = projections.keys, projections.values
        else:
            diagonal_keys.append(projections.keys)
            diagonal_values.append(projections.values)
        attended = causal_plus_diagonal_attention(projections.queries, keys0, values0, diagonal_keys, diagonal_values,
                                                  attention_backend)
        hidden = draft.finish(hidden, attended)
        # Logits only where the step has a target: the lm_head dominates the cost, and unsupervised
        # positions (prompts, padding, past the end) add nothing to the loss or the metrics.
        chosen = step_mask > 0
        logits = draft.logits(hidden[chosen])
        ploss, log_probs = step_loss(logits, step_probs[chosen], step_mask[chosen], normaliser=normaliser or step_mask.numel())
        output.loss = output.loss + decay ** step * ploss
        output.ploss.append(ploss)
        record_step_metrics(output, draft, log_probs, step_probs[chosen], step_top1[chosen], step_mask[chosen],
                            float(shift_left(supervised, step).sum()))
    return output


def record_step_metrics(output: TTTOutput, draft: Eagle3Draft, log_probs: torch.Tensor, target_probs: torch.Tensor,
                        target_top1: torch.Tensor, mask: torch.Tensor, supervised: float) -> None:
    """acc_k: draft top-1 (mapped to the target vocab) == target top-1, over all `supervised` positions of the
    step (a target top-1 outside the draft vocab is a miss); expected acceptance over the scored positions
    (`mask`: supervised, target top-1 in the draft vocab), against the teacher renormalised to the draft vocab."""
    with torch.no_grad():
        scored = float(mask.sum())
        draft_top1 = draft.draft_to_target(log_probs.argmax(dim=-1))
        correct = float(((draft_top1 == target_top1).float() * mask).sum())
        overlap = torch.minimum(log_probs.exp(), target_probs).sum(-1)
        accepted = float((overlap * mask).sum())
    output.acc.append(correct / supervised if supervised else 0.0)
    output.expected_accept.append(accepted / scored if scored else 0.0)
    output.supervised.append(supervised)
    output.scored.append(scored)
