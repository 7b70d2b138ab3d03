"""The reference decoder of a DFlash draft: each round drafts its whole chain from one block pass.

The decoding loop, the target's verification and the acceptance are the EAGLE3 decoder's (models/speculative.py);
only the draft side differs. The draft's cache holds every layer's context keys and values of the committed
positions whose target states are known (all but the newest token, the root): a round appends the states the last
verification produced, then runs the block [root, MASK x steps] right after them, each slot attending to the whole
context and the whole block, and chains slot j's greedy guess at depth j (as vLLM's dflash proposer drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from models.dflash import DFlashDraft, LayerContext
from models.draft_tree import DraftTree, add_top_children
from models.speculative import SpeculativeDecoder

Tensor = torch.Tensor


@dataclass
class DFlashContextCache:
    """Per layer, the context keys and values [1, kv_heads, L, head_dim] of committed positions 0..L-1."""

    layers: list[LayerContext] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.layers[0].keys.shape[2] if self.layers else 0

    def append(self, new: list[LayerContext]) -> None:
        if not self.layers:
            self.layers = new
            return
        self.layers = [LayerContext(torch.cat([old.keys, added.keys], dim=2), torch.cat([old.values, added.values], dim=2))
                       for old, added in zip(self.layers, new)]


class DFlashDecoder(SpeculativeDecoder):
    """SpeculativeDecoder with a DFlash draft (a chain: topk 1, steps + 1 tokens verified per round)."""

    draft: DFlashDraft

    def new_cache(self) -> DFlashContextCache:
        return DFlashContextCache()

    def draft_tree(self, cache: DFlashContextCache, aux: Tensor, ids: list[int], root: int) -> DraftTree:
        """Append the newly verified positions' states to the context, then draft the chain in one block pass."""
        device = self.draft.lm_head.weight.device
        dtype = self.draft.lm_head.weight.dtype
        start = cache.length
        positions = torch.arange(start, start + aux.shape[0], device=device)[None]
        cache.append(self.draft.context(aux[None].to(device=device, dtype=dtype), positions))
        logprobs = self.draft.draft_block(cache.layers, root, self.steps)
        tree = DraftTree(tokens=[root], parents=[-1], depths=[0], scores=[0.0])
        node = 0
        for slot in range(self.steps):
            node = add_top_children(tree, self.draft, node, logprobs[slot], 1)[0]
        return tree
