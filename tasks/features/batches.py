"""Turning captured feature records into right-padded TTT batches, with the teacher they were stored for.

Lossless records carry the target's final hidden state: the teacher is recomputed through the target's
lm_head, at the rows an objective learns from (`taught_rows`) and nowhere else. Compact records carry a sparse
top-k teacher over the draft vocab and the target's top-1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from models.shape_buckets import bucketed, shape_bucket
from models.teacher import Settled, Teacher
from models.ttt import TTTBatch
from tasks.features.shards import dense_teacher, dequantise_aux


@dataclass
class RecordTeaching:
    """One record's teaching: probs [R, Vd], top1 [R], in_draft [R] for its rows `rows` (None: every row)."""

    probs: torch.Tensor
    top1: torch.Tensor
    in_draft: torch.Tensor
    rows: Optional[torch.Tensor] = None


def taught_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """The rows of a record whose teaching some objective reads: each supervised token's own row (EAGLE3's and
    P-EAGLE's step k learns row u where token u is supervised, models/ttt.py) and the row before it (DFlash learns
    token u from row u - 1, models/dflash_objective.py). Prompt rows teach nothing, and on chat data they are
    nearly half the tokens: the teacher's full-vocabulary pass, the largest product of a record's first step, is
    not spent on them."""
    supervised = loss_mask.reshape(-1) > 0
    needed = supervised.clone()
    needed[:-1] |= supervised[1:]
    return needed.nonzero().squeeze(-1)


class SettledCache:
    """What the teacher's full-vocabulary pass settled for each record (models/teacher.Settled), by the record's
    index, from the first time the teacher saw it: stored states give the same top-1 and log-sum-exp every time,
    and that pass is the teacher's largest (49,152 columns for SmolLM2 against the draft vocabulary's 8,192), so
    later epochs and later evaluations skip it. 8 bytes per taught row, 12 with the log-normaliser. One cache per
    teacher mode and record set (the training records with one teacher, the eval records with another)."""

    def __init__(self) -> None:
        self.settled: dict[int, Settled] = {}

    def known(self, keys: Sequence[int]) -> Optional[Settled]:
        """The records' settled values end to end, or None unless every one of them is known."""
        if not keys or any(key not in self.settled for key in keys):
            return None
        return Settled.joined([self.settled[key] for key in keys])

    def remember(self, keys: Sequence[int], settled: Sequence[Settled]) -> None:
        for key, values in zip(keys, settled):
            self.settled[key] = values


def record_teachers(records: Sequence[Mapping[str, Any]], teacher: Teacher, keys: Optional[Sequence[int]] = None,
                    cache: Optional[SettledCache] = None) -> list[RecordTeaching]:
    """(target probs of the draft tokens, full-vocab top-1, top-1 in draft vocab) of each record. Lossless records'
    taught rows go through the teacher in one call (full chunks of rows, one padding to a shape bucket) and give
    what the teacher gives (with `cache` and the records' `keys`, from what it settled before); compact records
    stored their top-K renormalised over the draft vocab, so theirs sum to 1 and their expected acceptance reads as
    if the target kept no mass outside the draft vocab."""
    lossless = [index for index, record in enumerate(records) if "hidden_state" in record]
    teachings: dict[int, RecordTeaching] = {}
    if lossless:
        rows = {index: taught_rows(records[index]["loss_mask"]) for index in lossless}
        counts = [len(rows[index]) for index in lossless]
        lossless_keys = [keys[index] for index in lossless] if keys is not None and cache is not None else []
        known = cache.known(lossless_keys) if lossless_keys else None
        states = torch.cat([records[index]["hidden_state"][rows[index]] for index in lossless])
        taught = teacher.teach(states, known)
        if lossless_keys and known is None:
            cache.remember(lossless_keys, taught.settled.split(counts))
        for index, probs, top1, in_draft in zip(lossless, taught.probs.split(counts), taught.top1.split(counts),
                                                taught.in_draft.split(counts)):
            teachings[index] = RecordTeaching(probs, top1, in_draft, rows[index].to(teacher.device))
    for index, record in enumerate(records):
        if index not in teachings:
            teachings[index] = compact_teacher(record, teacher)
    return [teachings[index] for index in range(len(records))]


def compact_teacher(record: Mapping[str, Any], teacher: Teacher) -> RecordTeaching:
    """A compact record's stored top-K teacher as dense draft-vocab probabilities, with its stored top-1."""
    probs = dense_teacher(record["teacher_topk_ids"], record["teacher_topk_logprobs"], teacher.draft_vocab_size)
    top1 = record["target_top1"].long().to(teacher.device)
    return RecordTeaching(probs, top1, teacher.t2d[top1])


def collate(records: Sequence[Mapping[str, Any]], teacher: Teacher, pad_token_id: int = 0,
            keys: Optional[Sequence[int]] = None, cache: Optional[SettledCache] = None) -> TTTBatch:
    """Right-pad records to the longest, rounded up to a shape bucket (models/shape_buckets.py: a batch of a length
    seen before reuses its bf16 kernels); padding is never supervised. The batch lives where the teacher's lm_head
    is (the teacher is computed there); its aux states are in the teacher's compute dtype, the one the draft's fc
    reads them in under autocast (bf16 features are then never widened to fp32 and cast back). Rows the teacher
    was not computed for (`taught_rows`) hold zero probabilities, top-1 0 and not in the draft vocab."""
    length = bucketed(max(len(record["input_ids"]) for record in records), shape_bucket(teacher.dtype))
    size = len(records)
    width = record_width(records[0])
    draft_vocab_size = teacher.draft_vocab_size
    device = teacher.device
    batch = TTTBatch(
        input_ids=torch.full((size, length), pad_token_id, dtype=torch.long, device=device),
        loss_mask=torch.zeros(size, length, dtype=torch.long, device=device),
        aux_hidden_state=torch.zeros(size, length, width, dtype=teacher.dtype, device=device),
        target_probs=torch.zeros(size, length, draft_vocab_size, device=device),
        target_top1=torch.zeros(size, length, dtype=torch.long, device=device),
        target_top1_in_draft=torch.zeros(size, length, dtype=torch.bool, device=device),
    )
    teachings = record_teachers(records, teacher, keys, cache)
    for row, (record, teaching) in enumerate(zip(records, teachings)):
        count = len(record["input_ids"])
        batch.input_ids[row, :count] = record["input_ids"].long()
        batch.loss_mask[row, :count] = record["loss_mask"].long()
        batch.aux_hidden_state[row, :count] = dequantise_aux(record["aux_hidden_state"], record.get("aux_scale"),
                                                             teacher.dtype)
        where = slice(0, count) if teaching.rows is None else teaching.rows
        batch.target_probs[row, where] = teaching.probs
        batch.target_top1[row, where] = teaching.top1
        batch.target_top1_in_draft[row, where] = teaching.in_draft
    return batch


def record_width(record: Mapping[str, Any]) -> int:
    return int(record["aux_hidden_state"].shape[-1])
