"""Greedy equivalence as the dtype can hold it (tasks/common/greedy_agreement.py): exact in float32; in bfloat16 a
divergence passes only at a near-tie of the target (its float32 top-2 logit gap at the first differing token) and
under the mismatch-rate threshold, in the evaluate stage and on the benchmark's engine texts.

Every divergence is built from the real tiny target: its greedy continuation, then the same continuation with the
target's runner-up token at a chosen position; the gaps that choose the positions come from one full forward of the
target here, independent of the code under test, which must report the same gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from contract.config import EvaluationConfig, RunConfig
from models.speculative import target_generate
from tasks import benchmark, evaluate
from tasks.common.greedy_agreement import GreedyRule, greedy_rule, model_dtype, served_dtype
from tasks.data.held_out import EvalPrompt
from tasks.serving.client import ChatRequest, RequestResult
from tasks.serving.greedy_divergence import TextDivergences, chat_prompt_ids, engines_rule
from training_run import whole_word_target

QUESTIONS = ["What is the capital of France?", "Tell me a story about a small bird.", "Say hello.",
             "Write a Python function that adds two numbers."]
NEW_TOKENS = 24
CHAIN = evaluate.DecodeMode("chain", 3, 1, 4)


@pytest.fixture(scope="module")
def word_target(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The peaked tiny target that emits whole words only, so its greedy text tokenises back to its ids."""
    return whole_word_target(tiny_target_dir, tmp_path_factory.mktemp("greedy") / "word-target")


@dataclass
class Continuation:
    """A prompt, the target's greedy continuation, and per generated position the gap and runner-up token of the
    float32 reference model."""

    prompt_ids: list[int]
    tokens: list[int]
    gaps: list[float]
    best: list[int]
    runner_up: list[int]

    def diverged_at(self, position: int) -> list[int]:
        """The continuation with the runner-up token at `position`: what a flipped argmax there would emit."""
        return self.tokens[:position] + [self.runner_up[position]] + self.tokens[position:position + 3]


def continuation(generator, reference, prompt_ids: list[int]) -> Continuation:
    """`generator`'s greedy continuation of the prompt, and `reference`'s top-2 at each position of it."""
    tokens = target_generate(generator, prompt_ids, NEW_TOKENS)
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([prompt_ids + tokens])).logits[0].float()
    rows = logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(tokens)]
    top = rows.topk(2)
    gaps = (top.values[:, 0] - top.values[:, 1]).tolist()
    return Continuation(prompt_ids, tokens, gaps, top.indices[:, 0].tolist(), top.indices[:, 1].tolist())


def closest_and_widest(items: list[Continuation]) -> tuple[tuple[int, int], tuple[int, int], float]:
    """(item, position) of the smallest and of the largest reference gap where the reference's best token is the
    continuation's own, and a tolerance between them (their geometric mean)."""
    candidates = [(item.gaps[position], index, position) for index, item in enumerate(items)
                  for position in range(len(item.tokens)) if item.best[position] == item.tokens[position]]
    smallest, largest = min(candidates), max(candidates)
    assert largest[0] > 4 * smallest[0], "the target's gaps span enough to tell a near-tie from a wide margin"
    return smallest[1:], largest[1:], math.sqrt(smallest[0] * largest[0])


def chat_ids(tokenizer, question: str) -> list[int]:
    return chat_prompt_ids(tokenizer, [{"role": "user", "content": question}])


def evaluated(model_dir: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, list[Continuation], list[EvalPrompt]]:
    """The target loaded in `dtype`, its continuations of QUESTIONS (reference: the same weights in float32)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).float().eval()
    prompts = [EvalPrompt(f"q:{index}", 1, "chats", "-", chat_ids(tokenizer, question))
               for index, question in enumerate(QUESTIONS)]
    return model, [continuation(model, reference, prompt.input_ids) for prompt in prompts], prompts


def settings(margin: float, max_rate: float = 0.5) -> EvaluationConfig:
    return EvaluationConfig(greedy_near_tie_margin=margin, max_greedy_mismatch_rate=max_rate)


def judged_divergence(model, item: Continuation, prompt: EvalPrompt, position: int, margin: float,
                      max_rate: float = 0.5) -> tuple[dict, list[str], GreedyRule]:
    """evaluate's judgement of `item` diverging at `position`, one diverging output of len(QUESTIONS) compared."""
    rule = greedy_rule(model_dtype(model), settings(margin, max_rate))
    row = evaluate.mismatch(prompt, CHAIN, item.tokens, item.diverged_at(position))
    [judged] = evaluate.judged_mismatches(model, [row], [prompt.input_ids + item.tokens[:row["position"]]], rule)
    return judged, evaluate.greedy_failures([judged], len(QUESTIONS), rule), rule


def test_float32_outputs_must_be_identical_even_at_a_near_tie(word_target: Path) -> None:
    model, items, prompts = evaluated(word_target, torch.float32)
    (index, position), _, margin = closest_and_widest(items)
    judged, failures, rule = judged_divergence(model, items[index], prompts[index], position, margin)
    assert rule.exact and judged["position"] == position and judged["near_tie"]
    assert judged["margin"] == pytest.approx(items[index].gaps[position], rel=1e-4, abs=1e-5)
    [failure] = failures
    assert "float32" in failure and f"{prompts[index].key} (chain, first difference at token {position})" in failure


def test_a_bfloat16_divergence_at_a_near_tie_passes_and_is_reported(word_target: Path) -> None:
    model, items, prompts = evaluated(word_target, torch.bfloat16)
    (index, position), _, margin = closest_and_widest(items)
    judged, failures, rule = judged_divergence(model, items[index], prompts[index], position, margin)
    assert not rule.exact and rule.dtype == "bfloat16" and failures == []
    assert judged["prompt"] == prompts[index].key and judged["position"] == position and judged["near_tie"]
    assert judged["margin"] == pytest.approx(items[index].gaps[position], rel=1e-4, abs=1e-5)
    assert model_dtype(model) == "float32", "the margin was computed in float32"
    summary = rule.summary([judged], len(QUESTIONS))
    assert summary["mismatch_rate"] == 1 / len(QUESTIONS) and summary["near_ties"] == 1 and not summary["exact"]
    too_many = evaluate.greedy_failures([judged], 1, rule)
    assert len(too_many) == 1 and "1 of 1 greedy outputs" in too_many[0] and "max_greedy_mismatch_rate" in too_many[0]


def test_a_bfloat16_divergence_with_a_wide_margin_fails_naming_the_prompt(word_target: Path) -> None:
    model, items, prompts = evaluated(word_target, torch.bfloat16)
    _, (index, position), margin = closest_and_widest(items)
    judged, failures, _ = judged_divergence(model, items[index], prompts[index], position, margin, max_rate=1.0)
    assert not judged["near_tie"] and judged["margin"] >= margin
    [failure] = failures
    assert "not at a near-tie" in failure
    assert f"{prompts[index].key} (chain, first difference at token {position})" in failure


def engine_run(variant: str, dtype: str, texts: list[str]) -> benchmark.VariantRun:
    results = [RequestResult(index=index, prompt_id=f"q:{index}#turn1", text=text) for index, text in enumerate(texts)]
    return benchmark.VariantRun(variant=variant, report={"command": ["serve", "--dtype", dtype]}, results={8: results})


def test_engine_texts_are_judged_at_their_first_differing_token_by_the_engines_dtype(word_target: Path,
                                                                                     tmp_path: Path) -> None:
    """Without the drafter the engine wrote the target's greedy text; with it, at one request, the runner-up token at
    a near-tie (passes in bfloat16, fails in float32) or at a wide margin (fails, naming the request)."""
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "model": {"source": "local", "path": str(word_target)},
                                    "tracking": {"enabled": False}})
    (tmp_path / "target").symlink_to(word_target)
    tokenizer = AutoTokenizer.from_pretrained(word_target)
    model = AutoModelForCausalLM.from_pretrained(word_target, dtype=torch.float32).eval()
    items = [continuation(model, model, chat_ids(tokenizer, question)) for question in QUESTIONS]
    requests = [ChatRequest(index=index, prompt_id=f"q:{index}#turn1", messages=[{"role": "user", "content": question}])
                for index, question in enumerate(QUESTIONS)]
    plain = [tokenizer.decode(item.tokens) for item in items]
    assert [tokenizer(text, add_special_tokens=False)["input_ids"] for text in plain] == [item.tokens for item in items]
    tie, wide, margin = closest_and_widest(items)
    cfg = cfg.model_copy(update={"evaluation": settings(margin)})

    def compared(dtype: str, index: int, position: int) -> dict:
        drafted = list(plain)
        drafted[index] = tokenizer.decode(items[index].diverged_at(position))
        runs = [engine_run("baseline", dtype, plain)], [engine_run("eagle3", dtype, drafted)]
        rule = engines_rule(cfg, [measured.report["command"] for measured in runs[0] + runs[1]])
        judge = None if rule.exact else TextDivergences(cfg, requests, rule)
        return benchmark.judged_greedy("sglang", benchmark.compare_greedy_rounds(*runs, judge), rule)

    near = compared("bfloat16", *tie)
    assert near["status"] == "ok" and near["failures"] == [] and near["compared"] == len(QUESTIONS)
    [row] = near["mismatches"]
    assert row["prompt_id"] == f"q:{tie[0]}#turn1" and row["token_position"] == tie[1] and row["near_tie"]
    assert row["margin"] == pytest.approx(items[tie[0]].gaps[tie[1]], rel=1e-4, abs=1e-5)
    assert near["rule"]["dtype"] == "bfloat16" and near["rule"]["mismatch_rate"] == 1 / len(QUESTIONS)

    far = compared("bfloat16", *wide)
    assert far["status"] == "failed" and not far["mismatches"][0]["near_tie"]
    [failure] = far["failures"]
    assert failure.startswith("sglang: ") and f"q:{wide[0]}#turn1 (request {wide[0]}, concurrency 8" in failure

    exact = compared("float32", *tie)
    assert exact["status"] == "failed" and exact["rule"]["exact"] and "margin" not in exact["mismatches"][0]
    assert f"prompts q:{tie[0]}#turn1" in exact["failures"][0]


def test_the_engines_dtype_is_read_from_their_command_lines() -> None:
    cfg = RunConfig()
    assert served_dtype(["serve", "--dtype", "bfloat16", "--dtype", "float32"]) == "float32", "argparse keeps the last"
    assert served_dtype(["serve", "--dtype=float16"]) == "float16" and served_dtype(["serve"]) == "auto"
    assert engines_rule(cfg, [["--dtype", "float32"], ["--dtype=float32"]]).exact
    mixed = engines_rule(cfg, [["--dtype", "float32"], ["--dtype", "bfloat16"]])
    assert not mixed.exact and mixed.dtype == "bfloat16/float32"
    assert not engines_rule(cfg, [["serve"]]).exact, "an engine's own auto serves a 16-bit dtype"
