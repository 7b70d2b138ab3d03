"""The draft side of the reference speculative decoder: the EAGLE3 draft's KV cache, the dynamic draft tree
(EAGLE-2 / SGLang) and the ancestors-only tree masks shared with the target's verification.

Positions, with n committed tokens x_0..x_{n-1} whose last one (the root) is in neither KV cache yet:
  - the draft cache holds the step-0 keys and values of draft positions 0..n-2; position t read aux[t] (the
    target's states after x_0..x_t) and the embedding of x_{t+1} at RoPE position t (models/ttt.py);
  - a tree node at depth d >= 1 guesses x_{n-1+d}. The draft expands it at RoPE position n-2+d with its
    parent's carried output (h_out, normed for EAGLE 3.1; the root's is the last context position's), attending to
    the whole context plus its ancestors and itself only. That is exactly TTT step d at position t = n-2: the step-0 keys 0..t plus
    one key per earlier step at t (the "diagonal"), here the keys of the node's ancestors.
The keys of expanded nodes are temporary: they live for one round and are dropped, because the accepted
positions get their step-0 keys from the target's aux states in the next `draft_extend`, as in training.
A P-EAGLE draft (`parallel_drafting`, a chain) expands every node from the mask token and fc(mask_hidden) instead of
its token and its parent's output, as vLLM's one-pass parallel drafting reads them (the causal attention over the
round's earlier slots is the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from models.eagle3 import Eagle3Draft, StepProjections

Tensor = torch.Tensor


@dataclass
class DraftCache:
    """Draft keys and values [1, kv_heads, L, head_dim], grown along L (the context's step-0 keys, or a
    round's temporary tree keys)."""

    keys: Optional[Tensor] = None
    values: Optional[Tensor] = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: Tensor, values: Tensor) -> None:
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], dim=2)
        self.values = values if self.values is None else torch.cat([self.values, values], dim=2)


def masked_tree_attention(projections: StepProjections, keys: Tensor, values: Tensor, visible: Tensor) -> Tensor:
    """Attention of the step's queries over keys/values [1, kv_heads, L, d]; visible: bool [queries, L]."""
    groups = projections.queries.shape[1] // keys.shape[1]
    return F.scaled_dot_product_attention(
        projections.queries, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1),
        attn_mask=visible[None, None],
    )


def draft_extend(draft: Eagle3Draft, cache: DraftCache, aux: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Append context positions to the draft cache (step 0: hidden fc(aux[t]), token x_{t+1}) and run them.

    aux [1, m, 3H] and ids [1, m] (target ids) continue the cache at position cache.length. Returns what the last
    position carries to the next step (its h_out, normed with norm_output) [1, H] and its draft-vocab log-probs
    [Vd]: the distribution of the token after the root.
    """
    start = cache.length
    count = ids.shape[1]
    positions = torch.arange(start, start + count, device=ids.device)[None]
    hidden = draft.project(aux)
    projections = draft.project_qkv(ids, hidden, positions)
    cache.append(projections.keys, projections.values)
    visible = torch.ones(count, cache.length, dtype=torch.bool, device=ids.device).tril(diagonal=start)
    h_out = draft.finish(hidden, masked_tree_attention(projections, cache.keys, cache.values, visible))
    last = h_out[:, -1]
    return draft.carry(last), torch.log_softmax(draft.logits(last)[0].float(), dim=-1)


@dataclass
class DraftTree:
    """Draft tokens as a tree; node 0 is the root, and a parent always comes before its children."""

    tokens: list[int]          # target ids
    parents: list[int]         # -1 for the root
    depths: list[int]
    scores: list[float]        # cumulative draft log-prob of the root-to-node path (root: 0)
    expanded_logprobs: dict[int, Tensor] = field(default_factory=dict)  # draft log-probs [Vd] at expanded nodes

    @property
    def size(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        return self.size - 1

    def children(self) -> list[list[int]]:
        """Children of every node, best draft score first (the order in which sampling tries them)."""
        result: list[list[int]] = [[] for _ in self.tokens]
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                result[parent].append(node)
        for siblings in result:
            siblings.sort(key=lambda node: -self.scores[node])
        return result

    def path(self, node: int) -> list[int]:
        """Root-to-node node indices."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]


def ancestor_mask(parents: list[int]) -> Tensor:
    """bool [M, M]: row i is True at node i and its ancestors (tree attention, the tree form of causal)."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node in range(len(parents)):
        ancestor = node
        while ancestor >= 0:
            mask[node, ancestor] = True
            ancestor = parents[ancestor]
    return mask


def add_top_children(tree: DraftTree, draft: Eagle3Draft, parent: int, logprobs: Tensor, topk: int) -> list[int]:
    """Add the parent's top-k draft tokens (mapped to target ids) as children; returns the new nodes."""
    tree.expanded_logprobs[parent] = logprobs
    values, draft_ids = logprobs.topk(topk)
    target_ids = draft.draft_to_target(draft_ids)
    base = tree.scores[parent]
    return [tree.add(int(token), parent, base + float(value)) for value, token in zip(values, target_ids)]


def best_nodes(scores: list[float], nodes: list[int], count: int) -> list[int]:
    """The `count` nodes of best score; ties keep the earlier node (so a parent beats its equal-score child)."""
    order = torch.sort(-torch.tensor([scores[node] for node in nodes], dtype=torch.float64), stable=True).indices
    return [nodes[int(index)] for index in order[:count]]


@dataclass
class TreeKeys:
    """The temporary keys of the nodes expanded this round, and which node each key belongs to."""

    nodes: list[int] = field(default_factory=list)
    cache: DraftCache = field(default_factory=DraftCache)

    def append(self, nodes: list[int], projections: StepProjections) -> None:
        self.nodes.extend(nodes)
        self.cache.append(projections.keys, projections.values)


def expand(draft: Eagle3Draft, cache: DraftCache, tree: DraftTree, frontier: list[int],
           hidden_of: dict[int, Tensor], tree_keys: TreeKeys) -> Tensor:
    """One draft forward over the frontier nodes (ancestors-only attention); returns their log-probs [K, Vd]."""
    device = cache.keys.device
    ids = torch.tensor([[tree.tokens[node] for node in frontier]], device=device)
    hidden = torch.stack([hidden_of[tree.parents[node]] for node in frontier], dim=1)
    if draft.config.parallel_drafting:  # P-EAGLE: the slot reads the mask token and state, not its parent's guess
        ids, hidden = draft.mask_inputs(ids)
    depth = tree.depths[frontier[0]]
    positions = torch.full_like(ids, cache.length - 1 + depth)
    projections = draft.project_qkv(ids, hidden, positions)
    tree_keys.append(frontier, projections)
    lineage = torch.tensor([[key_node in tree.path(node) for key_node in tree_keys.nodes] for node in frontier],
                           dtype=torch.bool, device=device)
    context = torch.ones(len(frontier), cache.length, dtype=torch.bool, device=device)
    keys = torch.cat([cache.keys, tree_keys.cache.keys], dim=2)
    values = torch.cat([cache.values, tree_keys.cache.values], dim=2)
    visible = torch.cat([context, lineage], dim=1)
    h_out = draft.finish(hidden, masked_tree_attention(projections, keys, values, visible))
    carried = draft.carry(h_out)
    for column, node in enumerate(frontier):
        hidden_of[node] = carried[:, column]
    return torch.log_softmax(draft.logits(h_out)[0].float(), dim=-1)


def build_tree(draft: Eagle3Draft, cache: DraftCache, root_token: int, root_hidden: Tensor, root_logprobs: Tensor,
               topk: int, steps: int) -> DraftTree:
    """All candidates of a dynamic draft tree (SGLang's EAGLE-2 drafting).

    Depth 1 holds the root's top-k tokens. Each further step expands the k frontier nodes of best cumulative
    score, adds each one's top-k children (k*k candidates) and keeps the best k of them as the next frontier.
    `steps` depths in all; with topk 1 this is a chain of `steps` tokens.
    """
    tree = DraftTree(tokens=[root_token], parents=[-1], depths=[0], scores=[0.0])
    frontier = add_top_children(tree, draft, 0, root_logprobs, topk)
    hidden_of = {0: root_hidden}
    tree_keys = TreeKeys()
    for _ in range(steps - 1):
        logprobs = expand(draft, cache, tree, frontier, hidden_of, tree_keys)
        candidates: list[int] = []
        for row, node in enumerate(frontier):
            candidates += add_top_children(tree, draft, node, logprobs[row], topk)
        frontier = best_nodes(tree.scores, candidates, topk)
    return tree


def select_nodes(tree: DraftTree, num_draft_tokens: int) -> DraftTree:
    """The verify tree: the root plus the num_draft_tokens - 1 candidates of best cumulative score, reindexed.

    A child never scores above its parent (log-probs are <= 0) and ties keep the parent, so the kept nodes
    form a tree."""
    kept = [0] + sorted(best_nodes(tree.scores, list(range(1, tree.size)), num_draft_tokens - 1))
    index = {old: new for new, old in enumerate(kept)}
    parents = [-1] + [index[tree.parents[node]] for node in kept[1:]]
    return DraftTree(
        tokens=[tree.tokens[node] for node in kept], parents=parents, depths=[tree.depths[node] for node in kept],
        scores=[tree.scores[node] for node in kept],
        expanded_logprobs={index[node]: value for node, value in tree.expanded_logprobs.items() if node in index},
    )
