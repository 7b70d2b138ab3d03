"""evaluate stage on a trained tiny drafter: greedy equivalence on every prompt (against a reference that a bug
in the decoder's target forward cannot reach), the acceptance report and its arithmetic, training's lift over
the untrained drafter on held-out prompts, plots."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tasks import evaluate, train
from target_bugs import hide_first_cached_key
from training_run import copied_run, copy_run

TWO_TURNS = {
    "id": "mtbench:81", "source": "mtbench", "split": "eval", "metadata": {"category": "writing"},
    "provenance": {"file": "question.jsonl", "line": 1, "format": "mtbench"},
    "messages": [
        {"role": "user", "content": "Tell me about the capital of France."},
        {"role": "assistant", "content": "The capital of France is Paris.", "supervised": True},
        {"role": "user", "content": "Say hello to the lazy dog."},
        {"role": "assistant", "content": "Hello, lazy dog.", "supervised": True},
    ],
}  # asks nothing a training record asks (training_run.QUESTIONS)

#: Measured on this tiny run (chain / tree mean accept length): untrained 1.000 / 1.000, trained 1.353 / 1.394.
MIN_LIFT = 0.15


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, captured_tiny_run):
    cfg = copied_run(captured_tiny_run, tmp_path_factory.mktemp("evaluate") / "run")
    train.run(cfg)
    eval_path = cfg.output_path / "data" / "eval.jsonl"
    eval_path.write_text(eval_path.read_text() + json.dumps(TWO_TURNS) + "\n")
    settings = {"steps": 3, "topk": 2, "num_draft_tokens": 5, "max_new_tokens": 12}
    return cfg.model_copy(update={"evaluation": cfg.evaluation.model_copy(update=settings)})


@pytest.fixture(scope="module")
def trained_result(trained_run) -> evaluate.EvaluationResult:
    return evaluate.run(trained_run)


@pytest.fixture(scope="module")
def untrained_report(trained_run, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same prompts evaluated with the drafter the train stage starts from, exported untrained."""
    from models.target_heads import load_target_heads
    from tasks.training.outputs import export

    directory = tmp_path_factory.mktemp("untrained") / "run"
    copy_run(trained_run.output_path, directory)
    cfg = trained_run.model_copy(update={"output_dir": str(directory)})
    manifest = json.loads((directory / "features" / "manifest.json").read_text())
    draft = train.build_draft(cfg, load_target_heads(directory / "target"), manifest, torch.device("cpu"))
    export(cfg, draft, manifest, 0, 1, {}, "float32")
    return evaluate.run(cfg).report


def test_every_supervised_turn_is_a_prompt(trained_run) -> None:
    from tasks.common.target_info import load_tokenizer

    tokenizer = load_tokenizer(trained_run.output_path / "target", trained_run.model)
    prompts = evaluate.eval_prompts(trained_run.output_path / "data" / "eval.jsonl", tokenizer, 256, None)
    two_turns = [prompt for prompt in prompts if prompt.id == "mtbench:81"]
    assert [prompt.turn for prompt in two_turns] == [1, 2]
    first, second = (tokenizer.decode(prompt.input_ids) for prompt in two_turns)
    assert first.endswith("<|im_start|>assistant\n") and second.startswith(first)
    assert "The capital of France is Paris.<|im_end|>" in second and "Say hello to the lazy dog." in second
    assert two_turns[0].category == "writing" and two_turns[0].length_bucket == "<256"
    limited = evaluate.eval_prompts(trained_run.output_path / "data" / "eval.jsonl", tokenizer, 256, 2)
    assert [prompt.id for prompt in limited] == ["chats:6", "chats:7"]
    only = evaluate.eval_prompts(trained_run.output_path / "data" / "eval.jsonl", tokenizer, 256, None, ["mtbench"])
    assert only == two_turns


def test_stage_reports_acceptance_with_greedy_equivalence(trained_result) -> None:
    report = trained_result.report
    assert report["greedy_equivalence"] == "passed" and report["greedy_mismatches"] == []
    assert report["prompts"] == 4 and report["records"] == 3
    for mode, width in (("chain", 4), ("tree", 5)):
        numbers = report[mode]
        assert numbers["num_draft_tokens"] == width and numbers["rounds"] > 0
        check_acceptance_arithmetic(numbers, report["prompts"])
        assert len(numbers["acceptance_by_depth"]) == 3
        assert {"category=writing", "source=mtbench", "turn=2", "prompt_tokens<256"} <= set(numbers["buckets"])
        assert numbers["generated_tokens"] == report["target"]["generated_tokens"]
        assert 0.0 < numbers["draft_time_share"] < 1.0
    assert report["tree"]["mean_drafted_tokens"] == 4.0
    assert all(path.stat().st_size > 1000 for path in trained_result.plots)
    assert trained_result.summary()["chain_mean_accept_length"] == report["chain"]["mean_accept_length"]


def check_acceptance_arithmetic(numbers: dict[str, Any], prompts: int) -> None:
    """The mean accept length, the histogram and acceptance by depth describe the same rounds: a round that
    accepts d drafts counts once in the histogram at d + 1 and once at each depth up to d. A prompt costs one
    prefill forward besides its rounds and emits the prefill's token plus its rounds' tokens, less what the
    cut at max_new_tokens (or EOS) drops of its last round: at most `steps`."""
    rounds, steps = numbers["rounds"], numbers["steps"]
    histogram = {int(length): count for length, count in numbers["accept_length_histogram"].items()}
    assert sum(histogram.values()) == rounds
    accepted = sum(length * count for length, count in histogram.items())
    assert numbers["mean_accept_length"] == pytest.approx(accepted / rounds, rel=1e-12)
    assert 1.0 + sum(numbers["acceptance_by_depth"]) == pytest.approx(accepted / rounds, rel=1e-12)
    for depth, rate in enumerate(numbers["acceptance_by_depth"], start=1):
        assert rate == pytest.approx(sum(histogram[length] for length in histogram if length > depth) / rounds), depth
    assert numbers["target_forwards"] == rounds + prompts
    assert prompts + accepted - prompts * steps <= numbers["generated_tokens"] <= prompts + accepted


def test_training_lifts_held_out_acceptance_above_the_untrained_drafter(trained_result, untrained_report) -> None:
    """No prompt is a training record's: the held-out records (training_run) and TWO_TURNS."""
    trained = trained_result.report
    assert untrained_report["greedy_equivalence"] == "passed"
    for mode in ("chain", "tree"):
        before, after = untrained_report[mode]["mean_accept_length"], trained[mode]["mean_accept_length"]
        print(f"{mode}: mean accept length untrained {before:.3f}, trained {after:.3f}")
        assert after > before + MIN_LIFT, (mode, before, after)
        assert trained[mode]["acceptance_by_depth"][0] > untrained_report[mode]["acceptance_by_depth"][0] + MIN_LIFT


def test_a_target_forward_bug_fails_the_stage(trained_run, tmp_path: Path, monkeypatch) -> None:
    """A prefix-mask bug in the decoder's target forward: a cached baseline through the same forward would agree
    with the speculative output; the stage's reference (HF generate) does not, and the stage fails."""
    directory = tmp_path / "run"
    shutil.copytree(trained_run.output_path, directory)
    cfg = trained_run.model_copy(update={"output_dir": str(directory)})
    hide_first_cached_key(monkeypatch)
    with pytest.raises(evaluate.GreedyMismatch, match="speculative decoding changed"):
        evaluate.run(cfg)
    report = json.loads((directory / "evaluate" / "acceptance.json").read_text())
    assert report["greedy_equivalence"] == "failed" and report["greedy_mismatches"]


def test_a_bfloat16_evaluation_passes_near_ties_and_fails_a_target_forward_bug(trained_run, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """In bfloat16 the stage judges each divergence (first differing token, the target's float32 gap there, near-tie)
    instead of failing on it. These prompts decode alike in bfloat16 without a bug (a divergence would be a near-tie);
    the prefix-mask bug changes half of the outputs, above the mismatch rate this run allows, and fails the stage."""
    runs = {}
    for name in ("clean", "bug"):
        directory = tmp_path / name
        shutil.copytree(trained_run.output_path, directory)
        runs[name] = trained_run.model_copy(update={
            "output_dir": str(directory), "model": trained_run.model.model_copy(update={"dtype": "bfloat16"}),
            "evaluation": trained_run.evaluation.model_copy(update={"max_greedy_mismatch_rate": 0.25})})
    clean = evaluate.run(runs["clean"]).report
    rule = clean["greedy_rule"]
    assert clean["greedy_equivalence"] == "passed" and rule["dtype"] == "bfloat16" and not rule["exact"]
    assert rule["compared"] == 2 * clean["prompts"] and rule["near_ties"] == rule["diverged"] <= rule["compared"] / 4
    hide_first_cached_key(monkeypatch)
    with pytest.raises(evaluate.GreedyMismatch, match="computed in bfloat16"):
        evaluate.run(runs["bug"])
    report = json.loads((runs["bug"].output_path / "evaluate" / "acceptance.json").read_text())
    rule = report["greedy_rule"]
    assert report["greedy_equivalence"] == "failed" and rule["diverged"] == len(report["greedy_mismatches"]) > 0
    assert rule["mismatch_rate"] > rule["max_mismatch_rate"] or rule["near_ties"] < rule["diverged"]
    for row in report["greedy_mismatches"]:
        assert row["margin"] >= 0.0 and row["near_tie"] == (row["margin"] < rule["near_tie_margin"]), row


def test_suites_report_every_set_per_source_and_category_with_intervals(trained_run, tmp_path: Path) -> None:
    """evaluation.sets: the chain over every set's prompts, the reference prompt among them decoded once; per suite
    and category τ with a bootstrap interval; the reference sections stay the reference prompts'."""
    from contract.config import EvalSet

    directory = tmp_path / "run"
    shutil.copytree(trained_run.output_path, directory)
    settings = {"max_prompts": 1, "sources": ["chats"], "topk": 1,
                "sets": [EvalSet(source="chats"), EvalSet(source="mtbench", records=1)]}
    cfg = trained_run.model_copy(update={"output_dir": str(directory),
                                         "evaluation": trained_run.evaluation.model_copy(update=settings)})
    result = evaluate.run(cfg)
    report = result.report
    assert report["prompts"] == 1 and len(report["chain"]["per_prompt"]) == 1 and "tree" not in report
    suites = report["suites"]
    keys = [row["prompt"] for row in suites["per_prompt"]]
    assert keys == ["chats:6#turn1", "chats:7#turn1", "mtbench:81#turn1", "mtbench:81#turn2"]
    assert suites["per_prompt"][0] == report["chain"]["per_prompt"][0], "the reference prompt is decoded once"
    check_acceptance_arithmetic(suites, 4)
    for bucket, prompts in (("source=chats", 2), ("source=mtbench", 2), ("category=writing", 2)):
        values = suites["buckets"][bucket]
        assert values["prompts"] == prompts and values["low"] <= values["mean_accept_length"] <= values["high"]
    interval = suites["mean_accept_length_interval"]
    assert interval["prompts"] == 4 and interval["low"] <= suites["mean_accept_length"] <= interval["high"]
    summary = result.summary()
    assert summary["suites_mean_accept_length.source.mtbench"] == suites["buckets"]["source=mtbench"]["mean_accept_length"]
    assert (directory / "evaluate" / "acceptance_by_suite.png").stat().st_size > 1000
