"""The suites of evaluation.sets replayed on SGLang (`evaluation.sets_on: engine`), many prompts in flight.

SGLang cannot run here: a scripted in-process server (tests/sglang_generate_server.py) answers `/generate` with the
`meta_info` SGLang reports per request. Each prompt's verify rounds and tokens come from its own reply, so prompts
the engine batches together are still measured one by one, and two versions' suites pair prompt by prompt.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from contract.config_loading import ConfigError, load_config
from contract.reports import AcceptanceReport, BenchmarkReport, EngineSuites, PromptTokens
from report_builders import acceptance_report, benchmark_report, engine_report, mode_acceptance, speedup_rows
from sglang_generate_server import GenerateServer
from test_engine_agreement import offline_decode
from tasks.common.intervals import paired_difference
from tasks.data.held_out import EvalPrompt
from tasks.registry.comparison import SetComparison, compare_suites, measured_suites
from tasks.serving.generated_replies import GeneratedMemo
from tasks.serving.suite_replay import replay_suites, replay_units, suites_summary, unit_size
from tasks.serving.totals_agreement import replay_generate

BUDGET = 24
STEPS = 3
IN_FLIGHT = 4
SUITES = {"gsm8k": ["-"] * 6, "mtbench": ["writing", "math", "writing", "math", "coding", "coding"]}


def suite_prompts() -> list[EvalPrompt]:
    """Twelve prompts of two suites, each with its own token ids."""
    prompts = []
    for suite, categories in SUITES.items():
        for category in categories:
            number = len(prompts)
            prompts.append(EvalPrompt(f"{suite}:{number}", 1, suite, category, [200 + number, 7, 8]))
    return prompts


def decodes(prompts: list[EvalPrompt], shift: int = 0) -> dict[tuple[int, ...], list[int]]:
    """Per prompt, the accept length of each verify round (1..STEPS + 1), differing from prompt to prompt."""
    return {tuple(prompt.input_ids): [min(STEPS + 1, max(1, (index + round_number) % 4 + 1 - shift))
                                      for round_number in range(BUDGET)] for index, prompt in enumerate(prompts)}


def expected_decode(accept_lengths: list[int]) -> tuple[int, int]:
    """(verify rounds, tokens emitted with the prefill's) of a decode cut at BUDGET, the last round counted."""
    return offline_decode(accept_lengths, BUDGET)


def replayed_summary(server: GenerateServer, prompts: list[EvalPrompt], memo: GeneratedMemo) -> dict[str, Any]:
    """The suites replayed on the scripted server, IN_FLIGHT at a time, and the report's `suites` from them."""
    units = replay_units(prompts, unit_size("sglang", IN_FLIGHT))
    replay = replay_suites(SimpleNamespace(root_url=server.root_url), "sglang", units, BUDGET, 0.0, memo, IN_FLIGHT)
    return suites_summary("sglang", replay, units, STEPS, BUDGET, 0.0, IN_FLIGHT)


@pytest.mark.integration
def test_sglang_replays_the_suites_batched_and_counts_each_prompt_by_its_own_reply() -> None:
    prompts = suite_prompts()
    script = decodes(prompts)
    memo = GeneratedMemo()
    with GenerateServer(script, hold_s=0.05) as server:
        summary = replayed_summary(server, prompts, memo)
        sent = len(server.bodies)
        outside = EvalPrompt("mtbench:99", 1, "mtbench", "math", [299, 7, 8])
        server.decodes[tuple(outside.input_ids)] = [2] * BUDGET
        agreement = replay_generate(server.root_url, [prompts[3], outside], BUDGET, 0.0, memo)
    assert server.max_in_flight == IN_FLIGHT, "the prompts were in flight together, at most suite_concurrency"
    assert sent == len(prompts) and len(server.bodies) == sent + 1, "the agreement sent only the prompt outside"
    replayed = {row["prompt"]: row for row in summary["per_prompt"]}
    assert agreement[0]["verify_rounds"] == replayed[prompts[3].key]["rounds"], "read from the suite replay's reply"

    in_units = [unit.prompts[0] for unit in replay_units(prompts, 1)]  # suite by suite, category by category
    expected = [expected_decode(script[tuple(prompt.input_ids)]) for prompt in in_units]
    assert [(row["prompt"], row["rounds"], row["generated_tokens"]) for row in summary["per_prompt"]] == [
        (prompt.key, rounds, emitted) for prompt, (rounds, emitted) in zip(in_units, expected)], "one row per prompt"
    tau = sum(emitted - 1 for _, emitted in expected) / sum(rounds for rounds, _ in expected)
    assert summary["mean_accept_length"] == pytest.approx(tau) and summary["rounds"] == sum(r for r, _ in expected)
    interval = summary["mean_accept_length_interval"]
    assert interval["prompts"] == len(prompts) and interval["low"] < tau < interval["high"]
    assert summary["unit"] == "prompts" and summary["concurrency"] == IN_FLIGHT and summary["engine"] == "sglang"
    buckets = summary["buckets"]
    assert buckets["source=mtbench"]["prompts"] == 6 and buckets["category=coding"]["prompts"] == 2
    assert "acceptance_by_position" not in summary and "accepted_per_position" not in summary
    assert "no accepted tokens per draft position" in summary["per_position"]
    rows = EngineSuites.model_validate(summary).per_prompt
    assert all(isinstance(row, PromptTokens) for row in rows), "SGLang's rows carry tokens, not positions"


@pytest.mark.integration
def test_a_suite_reply_without_sglangs_verify_rounds_fails_naming_the_field() -> None:
    prompts = suite_prompts()[:3]
    with GenerateServer(decodes(prompts)) as server:
        server.reply = lambda body: {"text": "x", "meta_info": {"completion_tokens": 5}}  # started without drafting
        with pytest.raises(ValueError, match=r"/generate answered prompt gsm8k:\d#turn1 without "
                                             r"meta_info\.spec_verify_ct: not an SGLang server drafting"):
            replayed_summary(server, prompts, GeneratedMemo())


def sglang_serving(rows: list[dict[str, Any]]) -> BenchmarkReport:
    """A benchmark report whose SGLang engine replayed the suites into `rows` (its per-prompt rounds and tokens)."""
    units = replay_units(suite_prompts(), 1)
    suites = suites_summary("sglang", {"rows": rows, "seconds": 1.0}, units, STEPS, BUDGET, 0.0, IN_FLIGHT)
    check = {"status": "ok", "check": "totals", "min_p_value": 0.5}
    report = benchmark_report({"sglang": engine_report(speedup_rows((1, 1.8)), check)})
    report["engines"]["sglang"]["suites"] = suites
    return BenchmarkReport.model_validate(report)


def replay_rows(shift: int) -> list[dict[str, Any]]:
    """The rows an SGLang replay writes for the suite prompts, decoded with `shift` fewer tokens per round."""
    units = replay_units(suite_prompts(), 1)
    script = decodes(suite_prompts(), shift)
    rows = []
    for unit in units:
        rounds, emitted = expected_decode(script[tuple(unit.prompts[0].input_ids)])
        rows.append({"prompt": unit.key, "source": unit.source, "input_hash": unit.input_hash, "rounds": rounds,
                     "generated_tokens": emitted})
    return rows


def test_two_versions_suites_replayed_on_sglang_pair_prompt_by_prompt() -> None:
    acceptance = AcceptanceReport.model_validate(acceptance_report(mode_acceptance()))
    candidate_rows, champion_rows = replay_rows(shift=0), replay_rows(shift=1)
    candidate = measured_suites(acceptance, sglang_serving(candidate_rows))
    champion = measured_suites(acceptance, sglang_serving(champion_rows))
    assert candidate is not None and candidate.measured_by == "sglang engine" and candidate.unit == "prompts"
    comparisons = compare_suites(candidate, champion)
    assert set(comparisons) == set(SUITES)
    for name, comparison in comparisons.items():
        assert isinstance(comparison, SetComparison), comparison
        ours = [row for row in candidate_rows if row["source"] == name]
        theirs = [row for row in champion_rows if row["source"] == name]
        tau = [sum(row["generated_tokens"] - 1 for row in rows) / sum(row["rounds"] for row in rows)
               for rows in (ours, theirs)]
        assert (comparison.candidate, comparison.champion) == pytest.approx(tau)
        assert comparison.difference.prompts == 6 and comparison.difference.estimate == pytest.approx(tau[0] - tau[1])
        assert comparison.difference == paired_difference(comparison.candidate_rounds, comparison.champion_rounds)
        assert comparison.significant_gain, "one token more per round on every prompt"


def test_suites_on_the_engine_need_vllm_or_sglang_in_the_benchmark(tmp_path: Path) -> None:
    suites = ["evaluation.sets=[{source: mtbench}]", "evaluation.sets_on=engine"]
    on_sglang = load_config(None, [*suites, "benchmark.engines=[sglang]"])
    assert on_sglang.evaluation.sets_on == "engine" and on_sglang.benchmark.suite_engine == "sglang"
    assert load_config(None, [*suites, "benchmark.engines=[sglang, vllm]"]).benchmark.suite_engine == "sglang"
    with pytest.raises(ConfigError, match=r"evaluation.sets_on: engine replays the suites on one of \['vllm', "
                                          r"'sglang'\]; benchmark.engines is \[\]"):
        load_config(None, [*suites, "benchmark.engines=[]"])
