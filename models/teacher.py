"""The teacher the draft learns: the target's next-token distribution over the draft vocabulary, and whether the
target's own top-1 lies in it, computed from the target's final normed states through its lm_head.

The full-vocabulary logits are the largest product of a training step (T x V x H, V = 49,152 for SmolLM2, six times
the draft's own head) and were a third of an fp32 step. They are computed here in row chunks (never a whole
[T, V] fp32 matrix), in the trainer's compute dtype: in bf16 the matmul runs on the CPU's matrix units, the
log-sum-exp over the vocabulary is taken in fp32, and the top-1 is settled in fp32 among the few best bf16 logits,
so the loss mask and the accuracy metrics match the fp32 teacher's. In fp32 it is today's exact teacher.

A training step needs only what the loss teaches, the distribution renormalised over the draft vocabulary: that
is a softmax over the Vd draft logits, six times narrower than the log-sum-exp over the whole vocabulary, which was
the teacher's largest cost after the matmul. The full-vocabulary mass (whose share outside the draft vocabulary no
draft token can earn) is computed where expected acceptance is reported (`outside_mass=True`, the evaluations).
"""

from __future__ import annotations

import copy

import torch

from models.shape_buckets import pad_rows, shape_bucket

#: Rows of states per logits chunk: bounds the teacher's memory (256 x 49,152 fp32 = 48 MiB) at no cost in speed.
ROWS_PER_CHUNK = 256
#: bf16 candidates whose logits are recomputed in fp32 to pick the top-1 (bf16 rounding reorders near-ties only).
TOP1_CANDIDATES = 4


class Teacher:
    """Computes (target probabilities of the draft tokens, full-vocab top-1, top-1 in the draft vocab) for states.

    With `outside_mass` the probabilities are over the full vocabulary and not renormalised: the mass outside the
    draft vocab is what no draft token can earn in expected acceptance (the loss renormalises them,
    models/ttt.renormalised). Without it they are already renormalised over the draft vocab (each row sums to 1)."""

    def __init__(self, lm_head_weight: torch.Tensor, t2d: torch.Tensor, dtype: torch.dtype = torch.float32,
                 rows_per_chunk: int = ROWS_PER_CHUNK, outside_mass: bool = True) -> None:
        self.reference = lm_head_weight.float()
        self.weight = lm_head_weight.to(dtype)       # cast once per run, not once per batch
        self.t2d = t2d.to(lm_head_weight.device)
        self.draft_ids = self.t2d.nonzero().squeeze(-1)  # the draft vocab's target ids, in draft order
        self.dtype = dtype
        self.rows_per_chunk = rows_per_chunk
        self.outside_mass = outside_mass

    def with_outside_mass(self, outside_mass: bool) -> "Teacher":
        """The same teacher (sharing its cast weights) with or without the full-vocabulary mass."""
        other = copy.copy(self)
        other.outside_mass = outside_mass
        return other

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_ids.numel())

    def __call__(self, hidden_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For states [..., H]: probs float32 [..., Vd], top1 int64 [...], in_draft bool [...]."""
        leading = hidden_state.shape[:-1]
        count = leading.numel()
        rows = pad_rows(hidden_state.reshape(count, hidden_state.shape[-1]).to(self.device), shape_bucket(self.dtype))
        probs = torch.empty(rows.shape[0], self.draft_vocab_size, dtype=torch.float32, device=self.device)
        top1 = torch.empty(rows.shape[0], dtype=torch.int64, device=self.device)
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            for start in range(0, rows.shape[0], self.rows_per_chunk):
                chunk = slice(start, start + self.rows_per_chunk)
                probs[chunk], top1[chunk] = self.chunk(rows[chunk])
        probs, top1 = probs[:count], top1[:count]
        return probs.reshape(*leading, -1), top1.reshape(leading), self.t2d[top1].reshape(leading)

    def chunk(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft-token probabilities, top-1) of one chunk of rows."""
        logits = rows.to(self.dtype) @ self.weight.T
        draft_logits = logits.index_select(-1, self.draft_ids).float()
        if not self.outside_mass:
            return torch.softmax(draft_logits, dim=-1), self.top1(rows, logits)
        log_normaliser = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
        return torch.exp(draft_logits - log_normaliser), self.top1(rows, logits)

    def top1(self, rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The argmax; in a lower precision, the best of the top candidates rescored in fp32."""
        if self.dtype == torch.float32:
            return logits.argmax(dim=-1)
        candidates = logits.topk(TOP1_CANDIDATES, dim=-1).indices                          # [n, c]
        exact = (self.reference[candidates] * rows.float().unsqueeze(1)).sum(-1)          # [n, c] fp32
        return candidates.gather(-1, exact.argmax(dim=-1, keepdim=True)).squeeze(-1)


def teacher_from_hidden(hidden_state: torch.Tensor, lm_head_weight: torch.Tensor, t2d: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-off teacher of `hidden_state` (a run builds one Teacher and reuses its cast weight)."""
    return Teacher(lm_head_weight, t2d, dtype)(hidden_state)
