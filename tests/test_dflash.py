"""DFlash: the batched block objective equals one forward per block, blocks see only the context before their
anchor and their own slots, the anchors are drawn where they may be, and the labels are the tokens at a + k."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from models.dflash import DFlashConfig, DFlashDraft
from models.dflash_objective import anchor_candidates, block_inputs, dflash_forward, sample_anchors, slot_weight
from models.ttt import renormalised
from test_ttt import TINY, random_batch

pytestmark = pytest.mark.unit

TINY_DFLASH = DFlashConfig(**{**dataclasses.asdict(TINY), "mask_token_id": TINY.vocab_size - 1, "num_layers": 2,
                              "block_size": 4})


def tiny_dflash(seed: int = 0) -> DFlashDraft:
    torch.manual_seed(seed)
    draft = DFlashDraft(TINY_DFLASH)
    for parameter in draft.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    draft.attach_embedding(torch.randn(TINY.vocab_size, TINY.hidden_size))
    used = torch.sort(torch.randperm(TINY.vocab_size)[: TINY.draft_vocab_size]).values
    t2d = torch.zeros(TINY.vocab_size, dtype=torch.bool)
    t2d[used] = True
    draft.set_vocab_mapping(used - torch.arange(TINY.draft_vocab_size), t2d)
    return draft


def one_block_logits(draft: DFlashDraft, aux: torch.Tensor, ids: torch.Tensor, anchor: int) -> torch.Tensor:
    """The block anchored at `anchor` of one record alone: context rows 0..anchor-1, no mask at all."""
    block = draft.config.block_size
    context = draft.context(aux[None, :anchor], torch.arange(anchor)[None])
    slots = torch.full((1, block), draft.config.mask_token_id)
    slots[0, 0] = ids[anchor]
    positions = torch.arange(anchor, anchor + block)[None]
    visible = torch.ones(1, block, anchor + block, dtype=torch.bool)
    return draft.logits(draft.block_forward(slots, positions, context, visible))[0]


def reference_loss(draft: DFlashDraft, batch, anchors: torch.Tensor, keep: torch.Tensor, gamma: float) -> torch.Tensor:
    """The objective spelled out block by block: slot k learns the teacher row a + k - 1 where x_{a+k} is
    supervised, weighted where the target's top-1 is in the draft vocab, exp(-(k-1)/gamma) per slot."""
    size, length = batch.input_ids.shape
    total = torch.zeros(())
    for record in range(size):
        for column in range(anchors.shape[1]):
            if not keep[record, column]:
                continue
            anchor = int(anchors[record, column])
            logits = one_block_logits(draft, batch.aux_hidden_state[record], batch.input_ids[record], anchor)
            for slot in range(1, draft.config.block_size):
                token = anchor + slot
                if token >= length or not batch.loss_mask[record, token]:
                    continue
                row = token - 1
                teacher = renormalised(batch.target_probs[record, row])
                weight = float(batch.target_top1_in_draft[record, row])
                cross_entropy = -(teacher * F.log_softmax(logits[slot], dim=-1)).sum()
                total = total + slot_weight(slot, gamma) * weight * cross_entropy / (size * length)
    return total


def test_the_batched_objective_equals_one_forward_per_block_in_loss_and_gradients() -> None:
    batch = random_batch(batch=2, length=14, seed=3)
    anchors, keep = sample_anchors(batch.loss_mask, count=5, generator=torch.Generator().manual_seed(0))
    assert keep.any(dim=1).all(), "both records have anchors"
    draft = tiny_dflash()
    output = dflash_forward(draft, batch, anchors, keep, gamma=7.0)
    grads = torch.autograd.grad(output.loss, [draft.fc.weight, draft.layers[0].self_attn.k_proj.weight])
    reference = reference_loss(draft, batch, anchors, keep, gamma=7.0)
    expected = torch.autograd.grad(reference, [draft.fc.weight, draft.layers[0].self_attn.k_proj.weight])
    torch.testing.assert_close(output.loss, reference, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert len(output.acc) == draft.config.block_size - 1 and len(output.ploss) == 3


def test_a_block_reads_the_context_before_its_anchor_and_nothing_of_other_blocks() -> None:
    batch = random_batch(batch=1, length=16, seed=4)
    draft = tiny_dflash()
    anchors, keep = torch.tensor([[3, 9]]), torch.tensor([[True, True]])

    def block_logits(aux: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from models.dflash_objective import block_visibility

        context = draft.context(aux, torch.arange(16)[None])
        slots, positions = block_inputs(draft, ids, anchors)
        hidden = draft.block_forward(slots, positions, context, block_visibility(anchors, 4, 16))
        return draft.logits(hidden).view(2, 4, -1)

    base = block_logits(batch.aux_hidden_state, batch.input_ids)
    later = batch.aux_hidden_state.clone()
    later[0, 9:] += 5.0  # the anchor's own row and everything after: block 2 must not see them
    torch.testing.assert_close(block_logits(later, batch.input_ids)[1], base[1])
    before = batch.aux_hidden_state.clone()
    before[0, 8] += 5.0  # the row just before the anchor: block 2 reads it
    assert not torch.allclose(block_logits(before, batch.input_ids)[1], base[1])
    other_anchor = batch.input_ids.clone()
    other_anchor[0, 3] = (other_anchor[0, 3] + 1) % TINY.vocab_size  # block 1's anchor token
    changed = block_logits(batch.aux_hidden_state, other_anchor)
    torch.testing.assert_close(changed[1], base[1])
    assert all(not torch.allclose(changed[0, slot], base[0, slot]) for slot in range(4)), "the block is non-causal"


def test_anchors_are_distinct_sorted_supervised_and_capped() -> None:
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]])
    assert anchor_candidates(loss_mask).nonzero().tolist() == [[0, 1], [0, 2], [0, 5], [1, 0]]
    anchors, keep = sample_anchors(loss_mask, count=8, generator=torch.Generator().manual_seed(1))
    assert anchors.tolist() == [[1, 2, 5], [0, 0, 0]] and keep.tolist() == [[True] * 3, [True, False, False]]
    capped, capped_keep = sample_anchors(loss_mask, count=2, generator=torch.Generator().manual_seed(1))
    assert capped.shape == (2, 2) and capped_keep[0].all()
    assert set(capped[0].tolist()) <= {1, 2, 5} and capped[0, 0] < capped[0, 1]


def test_slot_labels_are_the_tokens_at_anchor_plus_k() -> None:
    """A teacher that puts all its mass on x_{a+k} (row a+k-1) and a draft trained a few steps on it: the
    draft's slot k then guesses x_{a+k}, never x_{a+k+1}."""
    batch = random_batch(batch=1, length=10, seed=5)
    ids = torch.randint(0, TINY.draft_vocab_size, (1, 10))
    draft = tiny_dflash()
    targets = draft.draft_to_target(ids)
    probs = torch.zeros(1, 10, TINY.draft_vocab_size)
    probs[0, torch.arange(9), ids[0, 1:]] = 1.0  # row r: the distribution of x_{r+1}
    batch = dataclasses.replace(batch, input_ids=targets, loss_mask=torch.ones(1, 10, dtype=torch.long),
                                target_probs=probs, target_top1=torch.cat([targets[:, 1:], targets[:, :1]], 1),
                                target_top1_in_draft=torch.ones(1, 10, dtype=torch.bool))
    anchors, keep = torch.tensor([[2]]), torch.tensor([[True]])
    optimizer = torch.optim.Adam(draft.parameters(), lr=0.05)
    for _ in range(60):
        optimizer.zero_grad()
        output = dflash_forward(draft, batch, anchors, keep)
        output.loss.backward()
        optimizer.step()
    assert output.acc == [1.0, 1.0, 1.0]
