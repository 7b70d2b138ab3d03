"""DFlash's training objective: random anchor blocks drafted in one pass, every block trained at once.

Features arrive token-aligned as for EAGLE3 (models/ttt.py): row t holds token x_t, its loss mask and the target's
states after x_0..x_t; teacher row t is the target's distribution of x_{t+1}. A block anchored at a reads the anchor
token x_a and block_size - 1 mask tokens at positions a..a+block_size-1, attends to the context rows t < a (the
target has not run x_a when the round drafts) and to its own slots both ways, and slot k >= 1 learns x_{a+k}:
the teacher row a + k - 1, where x_{a+k} is supervised (and, for the loss, where the target's top-1 is in the draft
vocabulary, as EAGLE3's loss). Blocks never see each other, so one forward over all of them equals one forward
per block (tests/test_dflash.py).

Where this follows SpecForge's DFlash (specforge 0.2): anchors drawn uniformly without replacement among positions
whose token and next token are supervised, at most `anchors` per record; context strictly before the anchor; slot
k predicts the token at a + k; slot weights exp(-(k - 1) / gamma). Where it differs: the label is the target's
distribution over the draft vocabulary (speculators' KL option, and eaglet's EAGLE3 loss) instead of the dataset
token, and each slot's loss is normalised like an EAGLE3 step (by the batch's token count), not by the sum of weights.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from models.dflash import DFlashDraft
from models.ttt import TTTBatch, TTTOutput, draft_mass, record_step_metrics, step_loss, supervised_logits


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: positions a whose token and next token are both supervised."""
    supervised = loss_mask > 0
    candidates = torch.zeros_like(supervised)
    candidates[:, :-1] = supervised[:, :-1] & supervised[:, 1:]
    return candidates


def sample_anchors(loss_mask: torch.Tensor, count: int,
                   generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, N], keep [B, N]): up to `count` distinct candidates per record, uniformly drawn and sorted;
    N is the most any record has (capped at `count`), a record with fewer pads with kept-out anchors at 0.
    Drawn from `generator`, else torch's global generator (whose state every training checkpoint saves)."""
    candidates = anchor_candidates(loss_mask)
    size = min(count, int(candidates.sum(dim=1).max())) if candidates.numel() else 0
    keys = torch.rand(candidates.shape, generator=generator, device="cpu").to(candidates.device)
    keys = torch.where(candidates, keys, torch.full_like(keys, -1.0))
    chosen = keys.topk(max(size, 1), dim=1)
    keep = chosen.values >= 0
    anchors = torch.where(keep, chosen.indices, torch.zeros_like(chosen.indices))
    order = torch.where(keep, anchors, torch.full_like(anchors, loss_mask.shape[1])).argsort(dim=1)
    return anchors.gather(1, order)[:, :size], keep.gather(1, order)[:, :size]


def block_inputs(draft: DFlashDraft, input_ids: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, positions) [B, N * block]: each block's anchor token then mask tokens, at positions a..a+block-1."""
    block = draft.config.block_size
    offsets = torch.arange(block, device=anchors.device)
    positions = anchors[:, :, None] + offsets
    ids = torch.full_like(positions, draft.config.mask_token_id)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    return ids.flatten(1), positions.flatten(1)


def block_visibility(anchors: torch.Tensor, block: int, length: int) -> torch.Tensor:
    """[B, N * block, length + N * block] bool: a slot sees context rows before its anchor and its own block."""
    size, count = anchors.shape
    context = torch.arange(length, device=anchors.device)[None, None, :] < anchors[:, :, None]
    same_block = torch.eye(count, dtype=torch.bool, device=anchors.device)
    context = context.repeat_interleave(block, dim=1)
    own = same_block.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return torch.cat([context, own[None].expand(size, -1, -1)], dim=2)


def slot_weight(slot: int, gamma: Optional[float]) -> float:
    """exp(-(slot - 1) / gamma): later guesses count less (SpecForge's examples use gamma 7); None weighs all alike."""
    return 1.0 if gamma is None else math.exp(-(slot - 1) / gamma)


def dflash_forward(draft: DFlashDraft, batch: TTTBatch, anchors: torch.Tensor, keep: torch.Tensor,
                   gamma: Optional[float] = 7.0, normaliser: Optional[int] = None, expected_acceptance: bool = True,
                   loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = step_loss) -> TTTOutput:
    """All blocks of the batch in one draft pass; loss = sum_k slot_weight(k) * ploss_k over slots k >= 1, each
    ploss_k and acc_k read like an EAGLE3 step's (models/ttt.py), so the trainer logs DFlash's slots as depths."""
    size, length = batch.input_ids.shape
    block = draft.config.block_size
    positions = torch.arange(length, device=batch.input_ids.device).expand(size, -1)
    context = draft.context(batch.aux_hidden_state, positions)
    ids, slot_positions = block_inputs(draft, batch.input_ids, anchors)
    visible = block_visibility(anchors, block, length)
    hidden = draft.block_forward(ids, slot_positions, context, visible).view(size, anchors.shape[1], block, -1)

    teacher_rows = batch.target_probs.reshape(size * length, -1)
    teacher_mass = draft_mass(teacher_rows)
    teacher_top1 = batch.target_top1.reshape(-1)
    in_draft = batch.target_top1_in_draft.reshape(-1)
    supervised_tokens = batch.loss_mask > 0
    output = TTTOutput(loss=hidden.new_zeros(()))
    for slot in range(1, block):
        guessed = anchors + slot  # the position of the token slot `slot` guesses
        inside = guessed < length
        chosen = keep & inside & supervised_tokens.gather(1, guessed.clamp(max=length - 1))
        batch_rows = torch.arange(size, device=anchors.device)[:, None].expand_as(anchors)
        rows = (batch_rows * length + guessed - 1)[chosen]
        logits = supervised_logits(draft, hidden[:, :, slot], chosen)
        mask = in_draft[rows].to(logits.dtype)
        ploss, log_probs = loss_fn(logits, teacher_rows[rows], teacher_mass[rows], mask,
                                   normaliser=normaliser or size * length)
        output.loss = output.loss + slot_weight(slot, gamma) * ploss
        output.ploss.append(ploss)
        record_step_metrics(output, draft, log_probs, teacher_rows[rows] if expected_acceptance else None,
                            teacher_top1[rows])
    return output
