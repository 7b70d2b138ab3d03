"""The reference speculative decoder: an HF Llama target verifies the EAGLE3 draft's chains or dynamic trees.

One round, with n committed tokens whose last one (the root, the previous round's bonus token) is not yet in
the target's KV cache (docs/architecture.md §3 alignment; models/draft_tree.py has the draft's positions):

    draft:  draft_extend over the positions the target just produced aux states for  -> the root's next-token
            distribution; build the tree (topk K, steps S) and keep the root + best N-1 nodes
    verify: one target forward over the tree tokens at positions (n-1) + depth, with a 4D mask that shows each
            node the cached prefix plus its ancestors only; forward hooks capture the aux layers' outputs
    accept: greedy (follow the target's argmax) or target-only tree sampling; bonus = the target's token after
            the last accepted node
    keep:   gather the accepted path's entries of the target cache; the accepted nodes' aux states feed the
            next round's draft_extend (the draft's tree keys were temporary)

Sampling at temperature T > 0 leaves the target's distribution unchanged: the drafts are deterministic (top-k),
so at a node with target probs p the children are tried in order, each accepted with probability p(child);
a rejected child's mass is removed and p renormalised; if all are rejected the token is drawn from what is left
(SGLang's "target only" tree sampling, a multi-candidate rejection sampler with point-mass drafts).

The greedy reference, `target_generate`, is HF `generate`: it shares none of TargetState's cache, mask and
position code, so a bug there shows as a greedy mismatch instead of agreeing with itself.

With `steps` S, `topk` 1 and `num_draft_tokens` S + 1 this is SGLang's chain mode; the tree mode matches
`--speculative-eagle-topk K --speculative-num-steps S --speculative-num-draft-tokens N`. Batch size 1.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch

from contract.config import draft_tree_capacity
from models.draft_tree import DraftCache, DraftTree, ancestor_mask, build_tree, draft_extend, select_nodes
from models.eagle3 import Eagle3Draft
from models.target_capture import captured_outputs, decoder_parts, resolve_aux_layer_ids

Tensor = torch.Tensor


def sliding_window_of(config: Any) -> Optional[int]:
    """The window of a target whose layer types include sliding attention; None when every layer sees all."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or []
    window = getattr(text, "sliding_window", None)
    return int(window) if window and "sliding_attention" in layer_types else None


def on_device(mask: Tensor | dict[str, Tensor], device: torch.device) -> Tensor | dict[str, Tensor]:
    if isinstance(mask, dict):
        return {kind: value.to(device) for kind, value in mask.items()}
    return mask.to(device)


class TargetState:
    """The target model and its KV cache for one sequence; every forward goes through `forward`."""

    def __init__(self, model: Any, aux_layer_ids: Sequence[int] = ()) -> None:
        from transformers import DynamicCache  # ~1 s to import: only where a target runs

        implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
        if implementation.startswith("flash"):
            raise ValueError(f"attention '{implementation}' ignores custom 4D masks; load the target with sdpa or eager")
        self.model = model
        self.aux_layer_ids = list(aux_layer_ids)
        self.sliding_window = sliding_window_of(model.config)
        # Every layer cached whole (a sliding layer's cache would drop keys that `keep` indexes by position).
        self.cache = DynamicCache() if self.sliding_window is not None else DynamicCache(config=model.config)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward(self, tokens: Sequence[int], positions: Tensor, visible: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """Run `tokens` after the cached prefix; returns (logits [q, V] fp32, aux [q, k*H] or None).

        positions: int [q]; visible: bool [q, q] between the new tokens (each also sees the whole prefix)."""
        with captured_outputs(self.model, self.aux_layer_ids) as captured:
            output = self.model(
                input_ids=torch.tensor([list(tokens)], device=self.device),
                attention_mask=on_device(self.attention_mask(visible, positions), self.device),
                position_ids=positions[None].to(self.device),
                cache=self.cache, use_cache=True,
            )
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1)[0] if self.aux_layer_ids else None
        return output.logits[0].float(), aux

    def attention_mask(self, visible: Tensor, positions: Tensor) -> Tensor | dict[str, Tensor]:
        """The additive 4D mask [1, 1, q, prefix + q]: every new token sees the cached prefix, and `visible` among
        the new tokens. A target with sliding-window layers (gpt-oss) gets one mask per layer type, the sliding
        one also hiding keys `sliding_window` or more positions back (the cache keeps every layer whole)."""
        prefix = torch.ones(visible.shape[0], self.length, dtype=torch.bool)
        allowed = torch.cat([prefix, visible.cpu()], dim=1)
        if self.sliding_window is None:
            return self.additive(allowed)
        key_positions = torch.cat([torch.arange(self.length), positions.cpu()])
        near = positions.cpu()[:, None] - key_positions[None, :] < self.sliding_window
        return {"full_attention": self.additive(allowed), "sliding_attention": self.additive(allowed & near)}

    def additive(self, allowed: Tensor) -> Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill(~allowed, torch.finfo(self.dtype).min)
        return mask[None, None]

    def keep(self, positions: Tensor) -> None:
        """Keep only these cache positions (the prefix and the accepted path): a gather, nothing is recomputed."""
        index = positions.to(self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(2, index)
            layer.values = layer.values.index_select(2, index)


def choose_token(logits: Tensor, temperature: float, generator: Optional[torch.Generator]) -> int:
    """The target's own next token: argmax at temperature 0, else a sample of softmax(logits / T)."""
    if temperature == 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def greedy_accept(tree: DraftTree, logits: Tensor) -> tuple[list[int], int]:
    """Walk from the root taking the child equal to the target's argmax; returns (path nodes, bonus token)."""
    children = tree.children()
    path = [0]
    while True:
        wanted = int(logits[path[-1]].argmax())
        match = [child for child in children[path[-1]] if tree.tokens[child] == wanted]
        if not match:
            return path, wanted
        path.append(match[0])


def sample_accept(tree: DraftTree, logits: Tensor, temperature: float,
                  generator: Optional[torch.Generator]) -> tuple[list[int], int]:
    """Target-only tree sampling (see the module docstring); returns (path nodes, bonus token)."""
    children = tree.children()
    path = [0]
    while True:
        probs = torch.softmax(logits[path[-1]].double().cpu() / temperature, dim=-1)
        accepted = None
        for child in children[path[-1]]:
            token = tree.tokens[child]
            if float(torch.rand((), dtype=torch.float64, generator=generator)) < float(probs[token]):
                accepted = child
                break
            probs[token] = 0.0
            probs = probs / probs.sum()
        if accepted is None:
            return path, int(torch.multinomial(probs, 1, generator=generator))
        path.append(accepted)


@dataclass
class SpeculativeStats:
    """Per-request numbers. A round's accept length is its accepted draft tokens + 1 (the bonus token), as in
    SGLang; it counts the whole round even when EOS or max_new_tokens cut the emitted tokens short."""

    max_depth: int
    accept_lengths: list[int] = field(default_factory=list)
    drafted_tokens: list[int] = field(default_factory=list)   # draft tokens verified per round (root excluded)
    target_forwards: int = 0                                  # prefill + one per round
    generated_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accept_lengths)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / self.rounds if self.rounds else 0.0

    def acceptance_by_depth(self) -> list[float]:
        """For depth d = 1..max_depth: the share of rounds that accepted at least d draft tokens."""
        if not self.rounds:
            return [0.0] * self.max_depth
        return [sum(length - 1 >= depth for length in self.accept_lengths) / self.rounds
                for depth in range(1, self.max_depth + 1)]

    @property
    def tokens_per_target_forward(self) -> float:
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    def summary(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "mean_accept_length": self.mean_accept_length,
                "acceptance_by_depth": self.acceptance_by_depth(),
                "mean_drafted_tokens": sum(self.drafted_tokens) / self.rounds if self.rounds else 0.0,
                "target_forwards": self.target_forwards, "generated_tokens": self.generated_tokens,
                "tokens_per_target_forward": self.tokens_per_target_forward,
                "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds}


def stop_ids(eos_token_id: Optional[int | Sequence[int]]) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return set(eos_token_id)


class TokenSink:
    """The emitted tokens; it stops at max_new_tokens and right after an EOS token, never beyond."""

    def __init__(self, max_new_tokens: int, eos_token_id: Optional[int | Sequence[int]]) -> None:
        self.tokens: list[int] = []
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids(eos_token_id)
        self.done = max_new_tokens <= 0

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            if self.done:
                return
            self.tokens.append(token)
            self.done = token in self.stop_ids or len(self.tokens) >= self.max_new_tokens


def prefill(target: TargetState, prompt_ids: Sequence[int]) -> tuple[Tensor, Optional[Tensor]]:
    """The causal forward over the prompt (the first target forward of any request)."""
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    length = len(prompt_ids)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return target.forward(prompt_ids, torch.arange(length), causal)


def target_generate(model: Any, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                    eos_token_id: Optional[int | Sequence[int]] = None,
                    generator: Optional[torch.Generator] = None) -> list[int]:
    """The target alone through HF `generate`: the reference a greedy speculative output must equal.

    `generate` keeps its own cache, causal mask and positions, so it shares none of TargetState's 4D-mask
    code: a bug there changes the speculative output and not this one, and the comparison sees it. Up to
    max_new_tokens tokens, stopping after an EOS; at temperature T > 0 a sample of softmax(logits / T) from
    the global RNG, seeded from `generator` (the caller's RNG state is left as it was)."""
    if max_new_tokens <= 0:
        return []
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    ids = torch.tensor([list(prompt_ids)], device=next(model.parameters()).device)
    with plain_generation_config(model), seeded_global_rng(generator), torch.inference_mode():
        output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                eos_token_id=sorted(stop_ids(eos_token_id)) or None, **sampling_settings(temperature))
    return output[0, len(prompt_ids):].tolist()


def sampling_settings(temperature: float) -> dict[str, Any]:
    """`generate`'s settings for the argmax (T = 0) or a sample of softmax(logits / T) over the whole vocabulary."""
    if temperature == 0.0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0}


@contextmanager
def plain_generation_config(model: Any) -> Iterator[None]:
    """`generate` fills every setting it is not given from the model's generation_config (a repetition penalty,
    top-p, a min length): a blank one for the call keeps the reference the target's own distribution."""
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


@contextmanager
def seeded_global_rng(generator: Optional[torch.Generator]) -> Iterator[None]:
    """`generate` samples from the global RNGs: seeded from `generator` when there is one, restored afterwards."""
    if generator is None:
        yield
        return
    seed = int(torch.randint(2**62, (), generator=generator))
    with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
        torch.manual_seed(seed)
        yield


class SpeculativeDecoder:
    """EAGLE3 speculative decoding of one sequence: `steps` draft depths, `topk` children per expanded node,
    `num_draft_tokens` tokens verified per round (root included; a chain needs topk 1 and steps + 1).
    A draft without an embedding gets the target's (attach_embedding), as the engines give it theirs."""

    def __init__(self, target: Any, draft: Eagle3Draft, aux_layer_ids: Optional[Sequence[int]] = None,
                 steps: int = 3, topk: int = 1, num_draft_tokens: Optional[int] = None) -> None:
        _, layers, _ = decoder_parts(target)
        layer_ids = list(aux_layer_ids) if aux_layer_ids is not None else list(draft.config.aux_layer_ids)
        if draft.config.aux_layer_ids and layer_ids != list(draft.config.aux_layer_ids):
            raise ValueError(f"aux_layer_ids {layer_ids} differ from the draft's {draft.config.aux_layer_ids}")
        self.aux_layer_ids = resolve_aux_layer_ids(layer_ids, len(layers))
        self.target, self.draft = target, draft
        self.steps, self.topk = steps, topk
        self.num_draft_tokens = steps + 1 if num_draft_tokens is None else num_draft_tokens
        self.check_shape()
        if draft.embed_tokens is None:
            draft.attach_embedding(target.get_input_embeddings().weight)

    def check_shape(self) -> None:
        """Refuse trees SGLang would refuse, and a draft built for another vocabulary."""
        if self.steps < 1 or not 1 <= self.topk <= self.draft.config.draft_vocab_size:
            raise ValueError(f"steps {self.steps} and topk {self.topk} must be >= 1 (topk <= the draft vocab)")
        capacity = draft_tree_capacity(self.steps, self.topk)
        if not 2 <= self.num_draft_tokens <= capacity:
            raise ValueError(f"num_draft_tokens {self.num_draft_tokens} must lie in [2, {capacity}] "
                             f"for steps {self.steps} and topk {self.topk}")
        vocab = self.target.get_output_embeddings().weight.shape[0]
        if self.draft.config.vocab_size != vocab:
            raise ValueError(f"the draft maps to a vocab of {self.draft.config.vocab_size}, the target has {vocab}")

    def accept(self, tree: DraftTree, logits: Tensor, temperature: float,
               generator: Optional[torch.Generator]) -> tuple[list[int], int]:
        """(accepted path nodes from the root, bonus token) for the target's logits at every tree node."""
        if temperature == 0.0:
            return greedy_accept(tree, logits)
        return sample_accept(tree, logits, temperature, generator)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 eos_token_id: Optional[int | Sequence[int]] = None,
                 generator: Optional[torch.Generator] = None) -> tuple[list[int], SpeculativeStats]:
        """Up to max_new_tokens tokens after the prompt (stopping after an EOS), and the request's stats."""
        if temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        stats = SpeculativeStats(max_depth=self.steps)
        sink = TokenSink(max_new_tokens, eos_token_id)
        if sink.done:
            return [], stats
        with torch.inference_mode():
            self.decode(prompt_ids, sink, stats, temperature, generator)
        stats.generated_tokens = len(sink.tokens)
        return sink.tokens, stats

    def decode(self, prompt_ids: Sequence[int], sink: TokenSink, stats: SpeculativeStats, temperature: float,
               generator: Optional[torch.Generator]) -> None:
        target, draft_cache = TargetState(self.target, self.aux_layer_ids), self.new_cache()
        started = time.perf_counter()
        logits, aux = prefill(target, prompt_ids)
        root = choose_token(logits[-1], temperature, generator)
        stats.target_forwards += 1
        stats.verify_seconds += time.perf_counter() - started
        sink.extend([root])
        # The draft's context positions t read aux[t] and token x_{t+1}: the prompt shifted by one, then the root.
        pending_aux, pending_ids = aux, list(prompt_ids[1:]) + [root]
        while not sink.done:
            started = time.perf_counter()
            tree = self.draft_tree(draft_cache, pending_aux, pending_ids, root)
            stats.draft_seconds += time.perf_counter() - started
            started = time.perf_counter()
            prefix = target.length
            logits, aux = target.forward(tree.tokens, prefix + torch.tensor(tree.depths), ancestor_mask(tree.parents))
            path, bonus = self.accept(tree, logits, temperature, generator)
            target.keep(torch.cat([torch.arange(prefix), prefix + torch.tensor(path)]))
            stats.verify_seconds += time.perf_counter() - started
            stats.target_forwards += 1
            stats.accept_lengths.append(len(path))
            stats.drafted_tokens.append(tree.size - 1)
            new_tokens = [tree.tokens[node] for node in path[1:]] + [bonus]
            sink.extend(new_tokens)
            pending_aux, pending_ids, root = aux[path], new_tokens, bonus

    def new_cache(self) -> Any:
        """The draft's empty cache of context positions (the EAGLE3 layer's keys and values)."""
        return DraftCache()

    def draft_tree(self, cache: DraftCache, aux: Tensor, ids: list[int], root: int) -> DraftTree:
        """Extend the draft's context with the newly verified positions, then draft the verify tree."""
        device = self.draft.lm_head.weight.device
        dtype = self.draft.lm_head.weight.dtype
        hidden, logprobs = draft_extend(self.draft, cache, aux[None].to(device=device, dtype=dtype),
                                        torch.tensor([ids], device=device))
        tree = build_tree(self.draft, cache, root, hidden, logprobs, self.topk, self.steps)
        return select_nodes(tree, self.num_draft_tokens)
