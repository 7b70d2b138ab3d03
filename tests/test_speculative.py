"""The reference speculative decoder on the tiny Llama target, with real forward passes only: greedy output
identical to the target's own (trained and random drafts, chains and trees, cut by max_new_tokens or EOS),
tree masks equal to per-branch decoding for the target and the draft, and sampling that keeps the target's
distribution (with proof that the check would catch a wrong sampler)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from contract.config import RunConfig, draft_tree_capacity
from models.dflash import DFlashDraft
from models.draft_methods import MASKED_METHODS, draft_objective, method_config, speculative_decoder
from models.draft_methods import new_draft as new_method_draft
from models.draft_tree import DraftCache, DraftTree, ancestor_mask, build_tree, draft_extend, select_nodes
from models.eagle3 import Eagle3Config, Eagle3Draft
from models.speculative import SpeculativeDecoder, TargetState, prefill, target_generate
from models.target_capture import capture_states
from models.teacher import teacher_from_hidden
from models.ttt import TTTBatch, causal_plus_diagonal_attention, ttt_forward
from models.vocab_mapping import build_vocab_mapping, count_tokens
from target_bugs import BUGS, cached_greedy_decode
from training_run import peaked_target

AUX_LAYERS = [1, 2, 3]
DRAFT_VOCAB = 128
TRAINED_TEXTS = [
    "What is the capital of France?",
    "Hello, how are you today?",
    "Tell me a story about a small bird.",
    "Write a Python function that adds two numbers.",
    "The quick brown fox",
    "Say hello.",
]
UNSEEN_TEXTS = ["Paris is a city", "def add(a, b):", "the lazy dog 0123"]
CONTINUATION = 48
CONFIGS = [(3, 1, 4), (3, 2, 6), (3, 3, 8), (3, 4, 8)]   # (steps, topk, num_draft_tokens): one chain, three trees


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matmuls are microseconds: a second OpenMP thread only adds sync cost (10x on a busy host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    directory = peaked_target(tiny_target_dir, tmp_path_factory.mktemp("speculative") / "peaked-target")
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_target_dir: Path) -> dict[str, list[list[int]]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    return {"trained": [encode(text) for text in TRAINED_TEXTS],
            "unseen": [encode(text) for text in UNSEEN_TEXTS] + [[tokenizer.bos_token_id]]}


def new_draft(model, d2t: torch.Tensor, t2d: torch.Tensor, method: str = "eagle3") -> Eagle3Draft:
    torch.manual_seed(0)
    base = Eagle3Config.from_target(model.config, int(d2t.numel()), AUX_LAYERS)
    config = method_config(base, method, num_layers=1, block_size=4)
    if method in MASKED_METHODS:
        config.mask_token_id = model.config.vocab_size - 1
    draft = new_method_draft(config)
    draft.set_vocab_mapping(d2t, t2d)
    draft.attach_embedding(model.get_input_embeddings().weight)
    draft.initialise_from_target(model.lm_head.weight, model.model.norm.weight)
    return draft


def self_distillation_batch(model, sequences: list[list[int]], t2d: torch.Tensor) -> TTTBatch:
    """Right-padded TTT features of the target's own greedy text (what the draft will be asked to predict)."""
    states = capture_states(model, sequences, AUX_LAYERS)
    length = max(len(sequence) for sequence in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    aux = torch.zeros(len(sequences), length, states[0][0].shape[-1])
    hidden = torch.zeros(len(sequences), length, model.config.hidden_size)
    for row, (sequence, (row_aux, row_hidden)) in enumerate(zip(sequences, states)):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
        aux[row, : len(sequence)], hidden[row, : len(sequence)] = row_aux, row_hidden
    probs, top1, in_draft = teacher_from_hidden(hidden, model.lm_head.weight, t2d)
    return TTTBatch(ids, mask, aux, probs, top1, in_draft)


@pytest.fixture(scope="module")
def trained_draft(target, prompts) -> Eagle3Draft:
    """A draft overfit (TTT, 3 steps) on the target's greedy continuations of the trained prompts."""
    return overfit_draft(target, prompts, "eagle3")


@pytest.fixture(scope="module")
def trained_eagle31_draft(target, prompts) -> Eagle3Draft:
    """The same, as EAGLE 3.1 (fc_norm, norm_output)."""
    return overfit_draft(target, prompts, "eagle3.1")


@pytest.fixture(scope="module")
def trained_peagle_draft(target, prompts) -> Eagle3Draft:
    """The same, as P-EAGLE (the second and third slots read the mask token and mask_hidden)."""
    return overfit_draft(target, prompts, "peagle")


def overfit_draft(target, prompts, method: str) -> Eagle3Draft:
    sequences = [prompt + target_generate(target, prompt, CONTINUATION) for prompt in prompts["trained"]]
    counts = count_tokens([(sequence, [1] * len(sequence)) for sequence in sequences], target.config.vocab_size)
    mapping = build_vocab_mapping(counts, target.config.vocab_size, DRAFT_VOCAB)
    draft = new_draft(target, mapping.d2t, mapping.t2d, method)
    batch = self_distillation_batch(target, sequences, mapping.t2d)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    for _ in range(200):
        optimizer.zero_grad()
        draft_objective(draft, batch, steps=3).loss.backward()
        optimizer.step()
    return draft.eval()


@pytest.fixture(scope="module")
def trained_dflash_draft(target, prompts) -> DFlashDraft:
    """The same, as DFlash (one layer, blocks of the root and 3 mask tokens)."""
    return overfit_draft(target, prompts, "dflash")


@pytest.fixture(scope="module")
def untrained_draft(target) -> Eagle3Draft:
    vocab = target.config.vocab_size
    return new_draft(target, torch.zeros(vocab, dtype=torch.int64), torch.ones(vocab, dtype=torch.bool)).eval()


def check_greedy_equivalence(decoder: SpeculativeDecoder, model, prompts: list[list[int]],
                             lengths: tuple[int, ...]) -> list[float]:
    """Speculative greedy output == the target's greedy output for every prompt and length; returns the
    mean accept length per prompt (at the longest length)."""
    means = []
    for prompt in prompts:
        expected = target_generate(model, prompt, max(lengths))
        for length in lengths:
            tokens, stats = decoder.generate(prompt, length)
            assert tokens == expected[:length], (prompt, length, decoder.topk)
            assert stats.generated_tokens == length and stats.target_forwards == stats.rounds + 1
            check_round_accounting(stats.accept_lengths, length)
        means.append(stats.mean_accept_length)
    return means


def check_round_accounting(accept_lengths: list[int], length: int) -> None:
    """The prefill's token plus every round's accepted drafts and bonus cover `length` tokens, and the last
    round was needed: the decoder neither stops short nor runs a round too many."""
    produced = 1 + sum(accept_lengths)
    before_last_round = produced - accept_lengths[-1] if accept_lengths else 0
    assert before_last_round < length <= produced, (accept_lengths, length)


@pytest.mark.parametrize("steps, topk, num_draft_tokens", CONFIGS)
def test_greedy_output_equals_the_targets_with_a_trained_draft(target, trained_draft, prompts, steps, topk,
                                                               num_draft_tokens) -> None:
    decoder = SpeculativeDecoder(target, trained_draft, AUX_LAYERS, steps, topk, num_draft_tokens)
    trained = check_greedy_equivalence(decoder, target, prompts["trained"], (1, 2, 7, 13, CONTINUATION))
    unseen = check_greedy_equivalence(decoder, target, prompts["unseen"], (5, 24))
    print(f"steps {steps} topk {topk} tokens {num_draft_tokens}: mean accept length trained {trained}, unseen {unseen}")
    assert sum(trained) / len(trained) > 2.0, trained


def test_a_round_cut_by_max_new_tokens_or_eos_emits_nothing_beyond(target, trained_draft, prompts) -> None:
    decoder = SpeculativeDecoder(target, trained_draft, AUX_LAYERS, steps=3, topk=2, num_draft_tokens=6)
    prompt = prompts["trained"][0]
    expected = target_generate(target, prompt, CONTINUATION)
    cut_rounds = 0
    for length in range(1, 16):
        tokens, stats = decoder.generate(prompt, length)
        assert tokens == expected[:length]
        cut_rounds += 1 + sum(stats.accept_lengths) > length      # the last round verified more than it emitted
    assert cut_rounds >= 3
    for stop in sorted(set(expected[5:20])):
        first = expected.index(stop)
        tokens, _ = decoder.generate(prompt, CONTINUATION, eos_token_id=[stop, -1])
        assert tokens == expected[: first + 1] == target_generate(target, prompt, CONTINUATION, eos_token_id=stop)
    tokens, stats = decoder.generate(prompt, 0)
    assert tokens == [] and stats.target_forwards == 0


def test_an_eagle31_draft_decodes_the_targets_greedy_output_and_is_accepted(target, trained_eagle31_draft,
                                                                           prompts) -> None:
    for steps, topk, num_draft_tokens in ((3, 1, 4), (3, 3, 8)):
        decoder = SpeculativeDecoder(target, trained_eagle31_draft, AUX_LAYERS, steps, topk, num_draft_tokens)
        means = check_greedy_equivalence(decoder, target, prompts["trained"], (24,))
        assert sum(means) / len(means) > 2.0, "trained on these continuations, its drafts are accepted"


def test_a_peagle_draft_decodes_the_targets_greedy_output_and_its_later_slots_are_accepted(
        target, trained_peagle_draft, prompts) -> None:
    decoder = SpeculativeDecoder(target, trained_peagle_draft, AUX_LAYERS, 3, 1, 4)
    means = []
    for prompt in prompts["trained"]:
        expected = target_generate(target, prompt, 24)
        tokens, stats = decoder.generate(prompt, 24)
        assert tokens == expected
        check_round_accounting(stats.accept_lengths, 24)
        means.append(stats.mean_accept_length)
        assert stats.acceptance_by_depth()[1] > 0.0, "the masked second slot is accepted too"
    assert sum(means) / len(means) > 2.0, means


def test_a_dflash_draft_decodes_the_targets_greedy_output_and_its_later_slots_are_accepted(
        target, trained_dflash_draft, prompts) -> None:
    decoder = speculative_decoder(target, trained_dflash_draft, aux_layer_ids=AUX_LAYERS, steps=3)
    means = []
    for prompt in prompts["trained"]:
        expected = target_generate(target, prompt, 24)
        tokens, stats = decoder.generate(prompt, 24)
        assert tokens == expected
        check_round_accounting(stats.accept_lengths, 24)
        means.append(stats.mean_accept_length)
        assert stats.acceptance_by_depth()[1] > 0.0, "the second slot is accepted too"
    assert sum(means) / len(means) > 2.0, means
    for prompt in prompts["unseen"][:2]:  # untrained text: still the target's output
        assert decoder.generate(prompt, 16)[0] == target_generate(target, prompt, 16)


def test_a_dflash_round_drafts_what_the_training_block_at_its_root_predicts(target, trained_dflash_draft,
                                                                           prompts) -> None:
    """The decoder's first round (context: the prompt's states; block: the target's first token and 3 masks)
    equals the training objective's block anchored at that token, slot by slot."""
    from models.dflash_objective import block_inputs, block_visibility

    draft = trained_dflash_draft
    prompt = prompts["trained"][0]
    root = target_generate(target, prompt, 1)[0]
    sequence = torch.tensor([prompt + [root]])
    with torch.no_grad():
        states = target(sequence, output_hidden_states=True).hidden_states
        aux = torch.cat([states[layer + 1] for layer in AUX_LAYERS], dim=-1)
        anchors = torch.tensor([[len(prompt)]])
        ids, positions = block_inputs(draft, sequence, anchors)
        context = draft.context(aux, torch.arange(sequence.shape[1])[None])
        hidden = draft.block_forward(ids, positions, context, block_visibility(anchors, 4, sequence.shape[1]))
        trained = draft.draft_to_target(draft.logits(hidden)[0, 1:].argmax(dim=-1)).tolist()
        decoder = speculative_decoder(target, draft, aux_layer_ids=AUX_LAYERS, steps=3)
        cache = decoder.new_cache()
        tree = decoder.draft_tree(cache, aux[0, :len(prompt)], prompt[1:] + [root], root)
    assert tree.tokens == [root, *trained] and tree.parents == [-1, 0, 1, 2]


def test_a_dflash_draft_refuses_a_tree(target, trained_dflash_draft) -> None:
    with pytest.raises(ValueError, match="DFlash draft drafts a chain"):
        speculative_decoder(target, trained_dflash_draft, aux_layer_ids=AUX_LAYERS, steps=3, topk=2,
                            num_draft_tokens=5)


@pytest.mark.parametrize("steps, topk, num_draft_tokens", [(3, 1, 4), (4, 3, 10)])
def test_greedy_output_equals_the_targets_with_a_random_draft(target, untrained_draft, prompts, steps, topk,
                                                              num_draft_tokens) -> None:
    decoder = SpeculativeDecoder(target, untrained_draft, AUX_LAYERS, steps, topk, num_draft_tokens)
    means = check_greedy_equivalence(decoder, target, prompts["trained"][:3] + prompts["unseen"], (3, 24))
    assert min(means) >= 1.0


@pytest.mark.parametrize("plant_bug", BUGS, ids=lambda bug: bug.__name__)
def test_a_target_forward_bug_that_a_cached_baseline_shares_is_caught(target, trained_draft, prompts, monkeypatch,
                                                                       plant_bug) -> None:
    """The reference (target_generate: HF generate) shares no code with TargetState: a wrong position or mask
    there changes the speculative output and not the reference, though a baseline decoded through TargetState
    (the old one) agrees with the broken decoder."""
    decoder = SpeculativeDecoder(target, trained_draft, AUX_LAYERS, steps=3, topk=2, num_draft_tokens=6)
    texts = prompts["trained"] + prompts["unseen"]
    expected = [target_generate(target, prompt, 24) for prompt in texts]
    plant_bug(monkeypatch)
    broken = [decoder.generate(prompt, 24)[0] for prompt in texts]
    assert [target_generate(target, prompt, 24) for prompt in texts] == expected, "the reference is untouched"
    assert broken == [cached_greedy_decode(target, prompt, 24) for prompt in texts], "the old baseline agrees"
    changed = sum(output != reference for output, reference in zip(broken, expected))
    print(f"{plant_bug.__name__}: {changed}/{len(texts)} greedy outputs differ from the reference")
    assert changed > 0, "the greedy-equivalence check sees the bug"


def test_the_reference_ignores_the_checkpoints_generation_defaults(target, prompts) -> None:
    """A checkpoint's generation_config (Qwen ships a repetition penalty, Llama top-p sampling) must not shape
    the greedy reference: it stays the target's plain argmax, and the model keeps its settings."""
    opinionated = copy.deepcopy(target)
    opinionated.generation_config.update(do_sample=True, top_p=0.5, repetition_penalty=1.5)
    for prompt in prompts["trained"][:3] + prompts["unseen"]:
        assert target_generate(opinionated, prompt, 24) == cached_greedy_decode(target, prompt, 24)
    assert opinionated.generation_config.repetition_penalty == 1.5


def drafted_tree(target, draft: Eagle3Draft, prompt: list[int], topk: int, steps: int,
                 num_draft_tokens: int) -> tuple[TargetState, DraftCache, DraftTree, DraftTree]:
    """The first round's state: the prefilled target, the draft cache (extended in two pieces, so the
    offset causal mask is exercised), all candidates and the verify tree."""
    state = TargetState(target, AUX_LAYERS)
    logits, aux = prefill(state, prompt)
    root = int(logits[-1].argmax())
    ids = torch.tensor([prompt[1:] + [root]])
    cache = DraftCache()
    half = len(prompt) // 2
    draft_extend(draft, cache, aux[None, :half], ids[:, :half])
    hidden, logprobs = draft_extend(draft, cache, aux[None, half:], ids[:, half:])
    candidates = build_tree(draft, cache, root, hidden, logprobs, topk, steps)
    return state, cache, candidates, select_nodes(candidates, num_draft_tokens)


def test_tree_verification_equals_decoding_each_branch_alone(target, trained_draft, prompts) -> None:
    prompt = prompts["unseen"][0]
    with torch.inference_mode():
        state, _, _, tree = drafted_tree(target, trained_draft, prompt, topk=3, steps=4, num_draft_tokens=10)
        assert max(tree.depths) >= 3 and len(set(tree.parents)) > max(tree.depths), "a branching tree"
        prefix = state.length
        logits, aux = state.forward(tree.tokens, prefix + torch.tensor(tree.depths), ancestor_mask(tree.parents))
        for node in range(tree.size):
            branch = prompt + [tree.tokens[i] for i in tree.path(node)]
            alone = target(torch.tensor([branch])).logits[0, -1]
            torch.testing.assert_close(logits[node], alone, atol=1e-5, rtol=1e-5)
            branch_aux, _ = capture_states(target, torch.tensor([branch]), AUX_LAYERS)
            torch.testing.assert_close(aux[node], branch_aux[-1], atol=1e-5, rtol=1e-5)
        deepest = max(range(tree.size), key=lambda node: tree.depths[node])
        path = tree.path(deepest)
        state.keep(torch.cat([torch.arange(prefix), prefix + torch.tensor(path)]))
        fresh = TargetState(target)
        prefill(fresh, prompt + [tree.tokens[i] for i in path])
        for kept, expected in zip(state.cache.layers, fresh.cache.layers):
            torch.testing.assert_close(kept.keys, expected.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(kept.values, expected.values, atol=1e-5, rtol=1e-5)


def ttt_logprobs(draft: Eagle3Draft, aux: torch.Tensor, ids: list[int], depth: int) -> list[torch.Tensor]:
    """The training-time test's view of one branch: log-probs at the last context position for steps 0..depth.

    aux [T, 3H] (context positions 0..T-1), ids = x_1..x_T then the branch tokens a_1..a_depth (P-EAGLE reads the
    mask token and fc(mask_hidden) at every step after the first instead)."""
    length = aux.shape[0]
    tokens = torch.tensor([ids])
    positions = torch.arange(length)[None]
    hidden = draft.project(aux[None])
    keys0 = values0 = None
    diagonal_keys, diagonal_values, result = [], [], []
    for step in range(depth + 1):
        step_ids = tokens[:, step: step + length]
        if step > 0 and draft.config.parallel_drafting:
            step_ids = torch.full_like(step_ids, draft.config.mask_token_id)
            hidden = draft.fc(draft.mask_hidden).expand(1, length, -1)
        projections = draft.project_qkv(step_ids, hidden, positions + step)
        if step == 0:
            keys0, values0 = projections.keys, projections.values
        else:
            diagonal_keys.append(projections.keys)
            diagonal_values.append(projections.values)
        attended = causal_plus_diagonal_attention(projections.queries, keys0, values0, diagonal_keys, diagonal_values)
        h_out = draft.finish(hidden, attended)
        result.append(torch.log_softmax(draft.logits(h_out[0, -1]).float(), dim=-1))
        hidden = draft.norm(h_out) if draft.config.norm_output else h_out  # EAGLE 3.1 carries the normed output
    return result


@pytest.mark.parametrize("method", ["eagle3", "eagle3.1", "peagle"])
def test_draft_tree_steps_equal_the_training_time_test_of_each_branch(target, prompts, method, request) -> None:
    fixture = {"eagle3": "trained_draft", "eagle3.1": "trained_eagle31_draft", "peagle": "trained_peagle_draft"}
    trained_draft = request.getfixturevalue(fixture[method])
    topk = 1 if method == "peagle" else 3  # P-EAGLE drafts a chain
    prompt = prompts["unseen"][1]
    with torch.inference_mode():
        aux, _ = capture_states(target, torch.tensor([prompt]), AUX_LAYERS)
        _, _, candidates, _ = drafted_tree(target, trained_draft, prompt, topk=topk, steps=4, num_draft_tokens=10)
        context_ids = prompt[1:] + [candidates.tokens[0]]
        assert len(candidates.expanded_logprobs) == 1 + 3 * topk
        for node, logprobs in candidates.expanded_logprobs.items():
            branch = [candidates.tokens[i] for i in candidates.path(node)[1:]]
            expected = ttt_logprobs(trained_draft, aux, context_ids + branch, len(branch))[-1]
            torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)


def test_invalid_tree_shapes_are_refused(target, untrained_draft) -> None:
    with pytest.raises(ValueError, match="num_draft_tokens 6 must lie in"):
        SpeculativeDecoder(target, untrained_draft, AUX_LAYERS, steps=3, topk=1, num_draft_tokens=6)
    with pytest.raises(ValueError, match="differ from the draft"):
        SpeculativeDecoder(target, untrained_draft, [0, 1, 2], steps=3)


@pytest.mark.parametrize("steps, topk", [(1, 3), (2, 2), (3, 4)])
def test_the_decoder_verifies_exactly_the_trees_the_config_allows(target, untrained_draft, steps: int, topk: int) -> None:
    """contract/config.py's tree rule (SGLang's) and the offline decoder's agree on the largest tree."""
    capacity = draft_tree_capacity(steps, topk)
    RunConfig.model_validate({"evaluation": {"steps": steps, "topk": topk, "num_draft_tokens": capacity}})
    SpeculativeDecoder(target, untrained_draft, AUX_LAYERS, steps=steps, topk=topk, num_draft_tokens=capacity)
    with pytest.raises(ValueError, match=f"evaluation.num_draft_tokens\n.*{capacity + 1} cannot be verified"):
        RunConfig.model_validate({"evaluation": {"steps": steps, "topk": topk, "num_draft_tokens": capacity + 1}})
    with pytest.raises(ValueError, match=f"num_draft_tokens {capacity + 1} must lie in \\[2, {capacity}\\]"):
        SpeculativeDecoder(target, untrained_draft, AUX_LAYERS, steps=steps, topk=topk, num_draft_tokens=capacity + 1)


# --- sampling -------------------------------------------------------------------------------------------

SAMPLES = 2000


class AlwaysAcceptDecoder(SpeculativeDecoder):
    """A wrong sampler: it takes the best draft child at every node, whatever the target says."""

    def accept(self, tree, logits, temperature, generator):
        children = tree.children()
        path = [0]
        while children[path[-1]]:
            path.append(children[path[-1]][0])
        probs = torch.softmax(logits[path[-1]].double() / temperature, dim=-1)
        return path, int(torch.multinomial(probs, 1, generator=generator))


class ForgetfulDecoder(SpeculativeDecoder):
    """A subtly wrong sampler: after rejecting children it samples from the full p, rejected tokens included."""

    def accept(self, tree, logits, temperature, generator):
        children = tree.children()
        path = [0]
        while True:
            probs = torch.softmax(logits[path[-1]].double() / temperature, dim=-1)
            accepted = None
            for child in children[path[-1]]:
                if float(torch.rand((), dtype=torch.float64, generator=generator)) < float(probs[tree.tokens[child]]):
                    accepted = child
                    break
            if accepted is None:
                return path, int(torch.multinomial(probs, 1, generator=generator))
            path.append(accepted)


def exact_pair_probs(model, prompt: list[int], temperature: float) -> torch.Tensor:
    """p(x1, x2) [V, V] of the target at this temperature, from one batched forward over every x1."""
    vocab = model.config.vocab_size
    with torch.inference_mode():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / temperature, dim=-1)
        batch = torch.cat([torch.tensor([prompt]).expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        second = torch.softmax(model(batch).logits[:, -1].double() / temperature, dim=-1)
    return first[:, None] * second


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of pair counts to probs [V, V]; cells expecting fewer than 5 are pooled into one."""
    expected = probs.flatten() * counts.sum()
    observed = counts.flatten().double()
    large = expected >= 5
    expected_bins = torch.cat([expected[large], expected[~large].sum()[None]])
    observed_bins = torch.cat([observed[large], observed[~large].sum()[None]])
    statistic = ((observed_bins - expected_bins) ** 2 / expected_bins).sum()
    degrees = len(expected_bins) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2.0), statistic / 2.0))


def sample_pairs(decoder: SpeculativeDecoder, prompt: list[int], samples: int, seed: int) -> tuple[torch.Tensor, int]:
    """Counts [V, V] of (x1, x2) over `samples` runs at temperature 1, and how many accepted a draft token."""
    vocab = decoder.target.config.vocab_size
    counts = torch.zeros(vocab, vocab, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    accepted = 0
    for _ in range(samples):
        tokens, stats = decoder.generate(prompt, 2, temperature=1.0, generator=generator)
        counts[tokens[0], tokens[1]] += 1
        accepted += stats.accept_lengths[0] > 1
    return counts, accepted


def test_speculative_sampling_keeps_the_targets_distribution(target, trained_draft, prompts) -> None:
    sharper = copy.deepcopy(target)          # T = 1 on a sharper head: drafts are often right, often wrong
    with torch.no_grad():
        sharper.lm_head.weight.mul_(3.0)
    prompt = prompts["trained"][0]
    probs = exact_pair_probs(sharper, prompt, temperature=1.0)
    decoder = SpeculativeDecoder(sharper, trained_draft, AUX_LAYERS, steps=2, topk=3, num_draft_tokens=5)
    counts, accepted = sample_pairs(decoder, prompt, SAMPLES, seed=0)
    p_value = chi_square_p_value(counts, probs)
    print(f"p = {p_value:.3f}; a draft token was accepted in {accepted}/{SAMPLES} samples")
    assert 0.2 * SAMPLES < accepted < 0.8 * SAMPLES, "both acceptance and rejection are exercised"
    assert p_value > 1e-3

    for wrong_sampler, samples in ((AlwaysAcceptDecoder, 200), (ForgetfulDecoder, 1000)):
        wrong = wrong_sampler(sharper, trained_draft, AUX_LAYERS, steps=2, topk=3, num_draft_tokens=5)
        wrong_counts, _ = sample_pairs(wrong, prompt, samples, seed=1)
        assert chi_square_p_value(wrong_counts, probs) < 1e-6, f"the check detects {wrong_sampler.__name__}"
