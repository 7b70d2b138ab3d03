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

The draft tokens' logits come from the draft vocabulary's rows of the lm_head alone (Vd x H, a sixth of the full
head); the full-vocabulary pass only settles what never changes for a record's states (`Settled`): the target's
top-1 and, with the outside mass, the log-sum-exp over the whole vocabulary. A trainer that has seen a record
passes them back (`known`), so later epochs and later evaluations skip the full-vocabulary pass altogether
(tasks/features/batches.SettledCache).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from models.shape_buckets import pad_rows, shape_bucket

#: Rows of states per logits chunk: bounds the teacher's memory (256 x 49,152 fp32 = 48 MiB) at no cost in speed.
ROWS_PER_CHUNK = 256
#: bf16 candidates whose logits are recomputed in fp32 to pick the top-1 (bf16 rounding reorders near-ties only).
TOP1_CANDIDATES = 4


@dataclass
class Settled:
    """What the full-vocabulary pass settles about states, which never changes for them: the target's top-1 [N]
    and, for a teacher with the outside mass, the log-sum-exp of the full-vocabulary logits [N] (fp32)."""

    top1: torch.Tensor
    log_normaliser: Optional[torch.Tensor] = None

    def split(self, counts: Sequence[int]) -> list["Settled"]:
        """Per record, for `counts` rows each (in order)."""
        top1 = self.top1.split(list(counts))
        normalisers = self.log_normaliser.split(list(counts)) if self.log_normaliser is not None else [None] * len(top1)
        return [Settled(part, normaliser) for part, normaliser in zip(top1, normalisers)]

    @staticmethod
    def joined(parts: Sequence["Settled"]) -> "Settled":
        """Records' settled values end to end (all with a log-normaliser, or none)."""
        normalisers = [part.log_normaliser for part in parts]
        joined = torch.cat(normalisers) if all(normaliser is not None for normaliser in normalisers) else None
        return Settled(torch.cat([part.top1 for part in parts]), joined)


@dataclass
class Teaching:
    """The teacher's answer for states [..., H]: probs float32 [..., Vd], top1 int64 [...], in_draft bool [...],
    and what its full-vocabulary pass settled (flat, for a cache)."""

    probs: torch.Tensor
    top1: torch.Tensor
    in_draft: torch.Tensor
    settled: Settled


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
        self.draft_weight = self.weight[self.draft_ids]  # the draft vocab's rows: its logits without the rest
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

    def __call__(self, hidden_state: torch.Tensor,
                 known: Optional[Settled] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probs, top1, in_draft) of `teach`."""
        teaching = self.teach(hidden_state, known)
        return teaching.probs, teaching.top1, teaching.in_draft

    def teach(self, hidden_state: torch.Tensor, known: Optional[Settled] = None) -> Teaching:
        """The teaching for states [..., H]. `known`: what this teacher settled for these very states before (flat);
        with it the full-vocabulary pass is skipped."""
        if known is not None and self.outside_mass and known.log_normaliser is None:
            raise ValueError("the known values lack the log-normaliser, which the outside mass needs")
        leading = hidden_state.shape[:-1]
        count = leading.numel()
        rows = pad_rows(hidden_state.reshape(count, hidden_state.shape[-1]).to(self.device), shape_bucket(self.dtype))
        probs = torch.empty(rows.shape[0], self.draft_vocab_size, dtype=torch.float32, device=self.device)
        top1 = torch.zeros(rows.shape[0], dtype=torch.int64, device=self.device)
        log_normaliser = torch.zeros(rows.shape[0], dtype=torch.float32, device=self.device)
        if known is not None:
            top1[:count] = known.top1.reshape(count)
            if self.outside_mass:
                log_normaliser[:count] = known.log_normaliser.reshape(count)
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            for start in range(0, rows.shape[0], self.rows_per_chunk):
                chunk = slice(start, start + self.rows_per_chunk)
                cast = rows[chunk].to(self.dtype)  # once per chunk: the draft logits and the full pass share it
                # From the draft rows even when the full pass below has every logit: a record's later (cached)
                # teachings then equal its first bit for bit (a bf16 product over 8,192 or 49,152 columns need not
                # round alike); the extra product is a sixth of the full one, on a record's first pass only.
                draft_logits = (cast @ self.draft_weight.T).float()
                if known is None:
                    top1[chunk], log_normaliser[chunk] = self.full_pass(rows[chunk], cast)
                if self.outside_mass:
                    probs[chunk] = torch.exp(draft_logits - log_normaliser[chunk].unsqueeze(-1))
                else:
                    probs[chunk] = torch.softmax(draft_logits, dim=-1)
        top1 = top1[:count]
        settled = Settled(top1, log_normaliser[:count] if self.outside_mass else None)
        return Teaching(probs[:count].reshape(*leading, -1), top1.reshape(leading), self.t2d[top1].reshape(leading),
                        settled)

    def full_pass(self, rows: torch.Tensor, cast_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-1, log-sum-exp over the full vocabulary) of one chunk; the log-sum-exp only with the outside mass
        (zeros without: the draft softmax does not need it)."""
        logits = cast_rows @ self.weight.T
        if not self.outside_mass:
            return self.top1(rows, logits), torch.zeros(rows.shape[0], device=rows.device)
        return self.top1(rows, logits), torch.logsumexp(logits.float(), dim=-1)

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
