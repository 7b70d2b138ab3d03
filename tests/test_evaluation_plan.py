"""The evaluation plan `eaglet config validate` prints (flows/evaluation_plan.py): an evaluation that would decode
every held-out record of a large corpus is seen on paper, and the GPU recipe's plan is one a node finishes in minutes."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from contract.config_loading import load_config
from flows.cli import app
from flows.evaluation_plan import evaluation_plan

REPO_ROOT = Path(__file__).resolve().parent.parent
GPU_RECIPE = REPO_ROOT / "configs" / "llama31-8b-sglang.yaml"


def test_the_gpu_recipe_plans_a_bounded_evaluation_that_finishes_in_minutes(tmp_path: Path) -> None:
    cfg = load_config(GPU_RECIPE, [f"output_dir={tmp_path}"])
    plan = evaluation_plan(cfg)
    reference = plan.items[0]
    assert reference.decodes == 3, "target alone, the chain and the tree (topk 10)"
    assert reference.prompts.value == 8 * 2 and not reference.prompts.at_least, "8 MT-bench records of 2 turns"
    suites = {item.name: item for item in plan.items if item.name.startswith("suite ")}
    assert set(suites) == {f"suite {name}" for name in ("mtbench", "gsm8k", "humaneval", "math500", "mbpp")}
    assert {name: item.prompts.value for name, item in suites.items()} == {
        "suite mtbench": 80 * 2, "suite gsm8k": 100, "suite humaneval": 100, "suite math500": 100, "suite mbpp": 100}
    assert all(item.where == "engine (benchmark)" for item in suites.values()), "replayed batched on SGLang"
    assert plan.trainer_eval_records.value == 512
    tokens = plan.offline_tokens().value
    assert tokens == 16 * 3 * 256, "offline: the reference prompts alone"
    assert plan.tokens_per_second == cfg.evaluation.expected_tokens_per_s
    assert plan.offline_seconds() == tokens / cfg.evaluation.expected_tokens_per_s
    assert plan.offline_seconds() < 3600, "the evaluation of a few-hour GPU run takes minutes, not days"


def test_without_max_prompts_a_corpus_without_limits_is_unbounded_and_said_so(tmp_path: Path) -> None:
    cfg = load_config(GPU_RECIPE, [f"output_dir={tmp_path}", "evaluation.max_prompts=null",
                                   "evaluation.sources=null", "capture.eval_records=null"])
    plan = evaluation_plan(cfg)
    assert plan.items[0].prompts.value is None, "every held-out record of ShareGPT + UltraChat (no limit)"
    assert plan.trainer_eval_records.value is None
    assert plan.offline_seconds() is None
    assert "no estimate: set evaluation.max_prompts" in "\n".join(plan.lines())


def test_a_source_without_a_turn_cap_is_a_lower_bound_and_the_rate_comes_from_the_last_report(tmp_path: Path) -> None:
    cfg = load_config(None, [f"output_dir={tmp_path}", "evaluation.max_prompts=4"])
    assert cfg.evaluation.expected_tokens_per_s is None
    before = evaluation_plan(cfg)
    assert before.tokens_per_second is None and before.offline_seconds() is None
    report = tmp_path / "evaluate" / "acceptance.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"target": {"generated_tokens": 1000, "tokens_per_second": 50.0}}))
    plan = evaluation_plan(cfg)
    assert plan.tokens_per_second == 50.0 and str(report) in plan.rate_origin
    reference = plan.items[0]
    uncapped = [source for source in cfg.data.sources if source.split != "train" and source.max_user_turns is None]
    assert reference.prompts.at_least == bool(uncapped)
    assert plan.offline_seconds() == plan.offline_tokens().value / 50.0


def test_config_validate_prints_the_plan_with_its_time(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["config", "validate", "--schema-only", "--config", str(GPU_RECIPE),
                                      f"output_dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    assert "evaluation plan (256 new tokens a decode):" in result.output
    assert "reference prompts (target alone, chain, tree): 16 prompts × 3 decode(s), offline" in result.output
    assert "trainer's eval: 512 held-out records" in result.output
    assert "suite mtbench: 160 prompts × 1 decode(s), engine (benchmark)" in result.output
    assert "offline decoding: 12,288 tokens, about 7 min at 30 tok/s (evaluation.expected_tokens_per_s)" \
        in result.output
