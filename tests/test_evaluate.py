"""evaluate stage on a trained tiny drafter: greedy equivalence on every prompt, the acceptance report, plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks import evaluate, train
from training_run import captured_run

TWO_TURNS = {
    "id": "mtbench:81", "source": "mtbench", "split": "eval", "metadata": {"category": "writing"},
    "provenance": {"file": "question.jsonl", "line": 1, "format": "mtbench"},
    "messages": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris.", "supervised": True},
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello, how are you today?", "supervised": True},
    ],
}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path):
    cfg = captured_run(tmp_path_factory.mktemp("evaluate") / "run", tiny_target_dir)
    train.run(cfg)
    eval_path = cfg.output_path / "data" / "eval.jsonl"
    eval_path.write_text(eval_path.read_text() + json.dumps(TWO_TURNS) + "\n")
    settings = {"steps": 3, "topk": 2, "num_draft_tokens": 5, "max_new_tokens": 12}
    return cfg.model_copy(update={"evaluation": cfg.evaluation.model_copy(update=settings)})


def test_every_supervised_turn_is_a_prompt(trained_run) -> None:
    from tasks.common.target_info import load_tokenizer

    tokenizer = load_tokenizer(trained_run.output_path / "target", False)
    prompts = evaluate.eval_prompts(trained_run.output_path / "data" / "eval.jsonl", tokenizer, 256, None)
    two_turns = [prompt for prompt in prompts if prompt.id == "mtbench:81"]
    assert [prompt.turn for prompt in two_turns] == [1, 2]
    first, second = (tokenizer.decode(prompt.input_ids) for prompt in two_turns)
    assert first.endswith("<|im_start|>assistant\n") and second.startswith(first)
    assert "The capital of France is Paris.<|im_end|>" in second and "Say hello." in second
    assert two_turns[0].category == "writing" and two_turns[0].length_bucket == "<256"
    limited = evaluate.eval_prompts(trained_run.output_path / "data" / "eval.jsonl", tokenizer, 256, 2)
    assert [prompt.id for prompt in limited] == ["chats:0", "chats:1"]
    only = evaluate.eval_prompts(trained_run.output_path / "data" / "eval.jsonl", tokenizer, 256, None, ["mtbench"])
    assert only == two_turns


def test_stage_reports_acceptance_with_greedy_equivalence(trained_run) -> None:
    result = evaluate.run(trained_run)
    report = json.loads(result.report_path.read_text())
    assert report["greedy_equivalence"] == "passed" and report["greedy_mismatches"] == []
    assert report["prompts"] == 4 and report["records"] == 3
    for mode, width in (("chain", 4), ("tree", 5)):
        numbers = report[mode]
        assert numbers["num_draft_tokens"] == width and numbers["rounds"] > 0
        assert 1.0 <= numbers["mean_accept_length"] <= numbers["steps"] + 1
        assert sum(numbers["accept_length_histogram"].values()) == numbers["rounds"]
        assert len(numbers["acceptance_by_depth"]) == 3
        assert numbers["acceptance_by_depth"] == sorted(numbers["acceptance_by_depth"], reverse=True)
        assert {"category=writing", "source=mtbench", "turn=2", "prompt_tokens<256"} <= set(numbers["buckets"])
        assert numbers["generated_tokens"] == report["target"]["generated_tokens"]
        assert 0.0 < numbers["draft_time_share"] < 1.0
    assert report["tree"]["mean_drafted_tokens"] == 4.0
    assert all(path.stat().st_size > 1000 for path in result.plots)
    assert result.summary()["chain_mean_accept_length"] == report["chain"]["mean_accept_length"]
