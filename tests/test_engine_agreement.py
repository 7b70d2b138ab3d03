"""The engine agreement check where the engine has no per-position counters (SGLang), its waiver, the typed stage
reports, and the flagship GPU recipe's gates as the registry evaluates them.

SGLang cannot run here: a scripted in-process server answers `/generate` with SGLang's `meta_info`, and the
offline side is planted as the evaluate stage writes it, decoded by the same script.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from contract.config import RunConfig
from contract.config_loading import ConfigError, load_config
from contract.reports import AcceptanceReport, BenchmarkReport, ReportError, load_report
from report_builders import acceptance_report, benchmark_report, engine_report, mode_acceptance, speedup_rows
from sglang_generate_server import GenerateServer
from tasks import benchmark, register
from tasks.registry.gates import WAIVED, GateInputs, evaluate_gates, gates_passed
from tasks.serving.totals_agreement import (PromptRounds, engine_rounds, offline_rounds, replay_generate,
                                            totals_verdict)

FLAGSHIP = Path(__file__).resolve().parents[1] / "configs" / "llama31-8b-sglang.yaml"
BUDGET = 32
STEPS = 3


def scripted_decodes(prompts: int = 8, shift: int = 0) -> dict[tuple[int, ...], list[int]]:
    """Per prompt, the accept length of every verify round (1..STEPS + 1): prompts differ, as real ones do."""
    return {(100 + number, 7, 8): [min(STEPS + 1, max(1, (number + round_number) % 4 + 1 - shift))
                                   for round_number in range(BUDGET)] for number in range(prompts)}


def offline_decode(accept_lengths: list[int], budget: int) -> tuple[int, int]:
    """(verify rounds, tokens emitted) as the offline decoder counts them: the prefill's token, then whole rounds,
    the last one cut at the budget but counted."""
    emitted, rounds = 1, 0
    for accept_length in accept_lengths:
        if emitted >= budget:
            break
        rounds, emitted = rounds + 1, min(budget, emitted + accept_length)
    return rounds, emitted


def prompt_key(ids: tuple[int, ...]) -> str:
    return f"mtbench:{ids[0]}#turn1"


def plant_offline(directory: Path, decodes: dict[tuple[int, ...], list[int]], steps: int = STEPS,
                  mean_accept_length: float = 2.5) -> None:
    """evaluate/acceptance.json for these decodes (and a draft config the failure message quotes)."""
    per_prompt = []
    for ids, lengths in decodes.items():
        rounds, emitted = offline_decode(lengths, BUDGET)
        accepted = [float(sum(length - 1 >= depth for length in lengths[:rounds])) for depth in range(1, steps + 1)]
        per_prompt.append({"prompt": prompt_key(ids), "rounds": rounds, "accepted_per_position": accepted,
                           "generated_tokens": emitted})
    rounds = sum(row["rounds"] for row in per_prompt)
    accepted = [sum(row["accepted_per_position"][depth] for row in per_prompt) for depth in range(steps)]
    chain = mode_acceptance(steps, rounds, accepted, per_prompt, mean_accept_length=mean_accept_length)
    (directory / "evaluate").mkdir(parents=True, exist_ok=True)
    (directory / "evaluate" / "acceptance.json").write_text(
        json.dumps(acceptance_report(chain, prompts=len(per_prompt), max_new_tokens=BUDGET)))
    (directory / "draft" / "sglang").mkdir(parents=True, exist_ok=True)
    (directory / "draft" / "sglang" / "config.json").write_text(json.dumps({"eagle_config": {
        "eaglet_aux_layer_ids": [1, 2, 3]}}))
    (directory / "draft" / "sglang" / "contract.json").write_text(json.dumps({"method": "eagle3"}))


def eval_prompts(decodes: dict[tuple[int, ...], list[int]]) -> list[Any]:
    """What tasks.data.held_out.eval_prompts gives the replay: a key and the rendered token ids."""
    return [SimpleNamespace(key=prompt_key(ids), input_ids=list(ids)) for ids in decodes]


def replayed(rows: list[dict[str, Any]]) -> list[benchmark.VariantRun]:
    return [benchmark.VariantRun(variant="eagle3", report={"agreement": rows})]


def run_config(directory: Path, **registry: Any) -> RunConfig:
    return RunConfig.model_validate({"output_dir": str(directory), "registry": registry})


# --- the totals check on a scripted SGLang server -------------------------------------------------------


@pytest.mark.integration
def test_an_sglang_engine_drafting_like_the_offline_decoder_passes_the_totals_check(tmp_path: Path) -> None:
    decodes = scripted_decodes()
    plant_offline(tmp_path, decodes)
    with GenerateServer(decodes) as server:
        rows = replay_generate(server.root_url, eval_prompts(decodes), BUDGET, 0.0)
    assert server.bodies[0] == {"input_ids": [100, 7, 8], "sampling_params": {"max_new_tokens": BUDGET,
                                                                            "temperature": 0.0}}
    check = benchmark.check_agreement(run_config(tmp_path), "sglang", replayed(rows), steps=STEPS)
    assert check["status"] == "ok" and check["check"] == "totals", check.get("reason")
    assert check["min_p_value"] == 1.0 and check["engine_mean_accept_length"] == check["offline_mean_accept_length"]
    assert check["totals"]["engine"]["rounds"] == check["totals"]["offline"]["rounds"] >= 50
    assert check["prompts"] == 8 and check["max_new_tokens"] == BUDGET


@pytest.mark.integration
def test_an_sglang_engine_accepting_less_than_offline_fails_the_totals_check(tmp_path: Path) -> None:
    offline = scripted_decodes()
    plant_offline(tmp_path, offline)
    with GenerateServer(scripted_decodes(shift=2)) as server:  # two tokens fewer per round, at least the bonus
        rows = replay_generate(server.root_url, eval_prompts(offline), BUDGET, 0.0)
    check = benchmark.check_agreement(run_config(tmp_path), "sglang", replayed(rows), steps=STEPS)
    assert check["status"] == "failed" and check["min_p_value"] < 0.01
    assert check["engine_mean_accept_length"] < check["offline_mean_accept_length"]
    assert "tokens per verify round engine" in check["reason"] and "docs/architecture.md §3" in check["reason"]
    report = BenchmarkReport.model_validate(benchmark_report({"sglang": engine_report(
        speedup_rows((1, 1.8)), check, failures=(check["reason"],))}))
    gate = {gate.name: gate for gate in evaluate_gates(gate_inputs(report), run_config(tmp_path).registry)}
    assert gate["engine_acceptance[sglang]"].status == "failed"
    assert gate["engine_acceptance[sglang]"].detail.startswith("p-value of tokens per verify round")


@pytest.mark.integration
def test_a_reply_without_sglangs_counters_is_refused_naming_the_field() -> None:
    decodes = scripted_decodes(prompts=1)
    with GenerateServer(decodes) as server:
        server.reply = lambda body: {"text": "x", "meta_info": {"completion_tokens": 4}}  # speculative decoding off
        with pytest.raises(ValueError, match=r"/generate answered prompt mtbench:100#turn1 without "
                                             r"meta_info.spec_verify_ct"):
            replay_generate(server.root_url, eval_prompts(decodes), BUDGET, 0.0)


def test_tokens_per_round_leave_out_the_prefill_token_and_count_a_cut_round_alike_on_both_sides() -> None:
    """Rounds of 4 tokens under a budget of 10: 1 (prefill) + 4 + 4 + 1 (the third round cut) on both sides."""
    rounds, emitted = offline_decode([4, 4, 4, 4], 10)
    assert (rounds, emitted) == (3, 10)
    engine = engine_rounds([{"prompt": "p", "verify_rounds": 3, "completion_tokens": 10}])
    offline = offline_rounds(AcceptanceReport.model_validate(acceptance_report(mode_acceptance(
        per_prompt=[{"prompt": "p", "rounds": 3, "accepted_per_position": [3, 3, 3], "generated_tokens": 10}]))).chain.per_prompt)
    assert engine == offline == [PromptRounds("p", 3, 9)]


def test_too_few_rounds_or_prompts_is_inconclusive_with_the_numbers() -> None:
    few = [PromptRounds(f"p{n}", 5, 10) for n in range(3)]
    verdict = totals_verdict(few, few, alpha=0.01, min_drafts=50)
    assert verdict["status"] == "inconclusive" and "over 15 rounds" in verdict["reason"]
    one = [PromptRounds("p", 80, 160)]
    assert totals_verdict(one, one, alpha=0.01, min_drafts=50)["status"] == "inconclusive", "no spread to test"


def test_an_evaluation_on_other_prompts_fails_the_totals_check() -> None:
    verdict = totals_verdict([PromptRounds("a", 60, 120)], [PromptRounds("b", 60, 120)], 0.01, 50)
    assert verdict["status"] == "failed" and "no prompt a" in verdict["reason"]


# --- the waiver -----------------------------------------------------------------------------------------


def gate_inputs(serving: BenchmarkReport, chain_accept_length: float = 2.5) -> GateInputs:
    acceptance = AcceptanceReport.model_validate(acceptance_report(mode_acceptance(
        mean_accept_length=chain_accept_length)))
    return GateInputs(acceptance, serving, {"passed": True, "violations": []}, "rev", "evalset", None)


def unmeasured_sglang(cfg: RunConfig) -> BenchmarkReport:
    """An SGLang benchmark whose agreement measured nothing: no replay at the evaluation's chain length."""
    check = benchmark.check_agreement(cfg, "sglang", [benchmark.VariantRun(variant="eagle3", report={})], steps=STEPS)
    return BenchmarkReport.model_validate(benchmark_report({"sglang": engine_report(speedup_rows((1, 1.8)), check)}))


def test_an_unmeasured_agreement_without_a_waiver_blocks_champion(tmp_path: Path) -> None:
    plant_offline(tmp_path, scripted_decodes())
    cfg = run_config(tmp_path, waive_gates={"speedup": "waives another gate, not this one"})
    report = unmeasured_sglang(cfg)
    assert report.engines["sglang"].acceptance_check.status == "skipped"
    gates = {gate.name: gate for gate in evaluate_gates(gate_inputs(report), cfg.registry)}
    gate = gates["engine_acceptance[sglang]"]
    assert gate.status == "not run" and gate.blocks and not gates_passed(list(gates.values()))
    assert "waive with registry.waive_gates: {engine_acceptance: <why it cannot be measured>}" in gate.describe()


def test_a_waiver_with_its_reason_lets_the_unmeasured_agreement_through(tmp_path: Path) -> None:
    plant_offline(tmp_path, scripted_decodes())
    reason = "the serving fleet's SGLang build strips meta_info"
    cfg = run_config(tmp_path, waive_gates={"engine_acceptance": reason})
    check = unmeasured_sglang(cfg).engines["sglang"].acceptance_check
    assert (check.status, check.check) == ("skipped", None), "the benchmark reports; the registry waives"
    gates = {gate.name: gate for gate in evaluate_gates(gate_inputs(unmeasured_sglang(cfg)), cfg.registry)}
    gate = gates["engine_acceptance[sglang]"]
    assert gate.status == WAIVED and not gate.blocks and gates_passed(list(gates.values()))
    assert gate.describe().endswith(f"waived by registry.waive_gates.engine_acceptance: {reason}")
    assert gate.as_json()["waived_by"] == f"registry.waive_gates.engine_acceptance: {reason}"

    self_waived = {"status": "waived", "check": "totals", "reason": "a benchmark waiving its own check"}
    with pytest.raises(ValidationError, match="acceptance_check.status"):  # only the config waives
        BenchmarkReport.model_validate(benchmark_report({"sglang": engine_report(speedup_rows((1, 1.8)), self_waived)}))


def test_a_measured_agreement_is_judged_whatever_the_waiver_says(tmp_path: Path) -> None:
    plant_offline(tmp_path, scripted_decodes())
    rows = [{"prompt": prompt.key, "verify_rounds": 40, "completion_tokens": 41} for prompt in
            eval_prompts(scripted_decodes())]  # accepts nothing
    cfg = run_config(tmp_path, waive_gates={"engine_acceptance": "any"})
    check = benchmark.check_agreement(cfg, "sglang", replayed(rows), steps=STEPS)
    assert check["status"] == "failed" and check["check"] == "totals"
    report = BenchmarkReport.model_validate(benchmark_report({"sglang": engine_report(
        speedup_rows((1, 1.8)), check, failures=(check["reason"],))}))
    gate = {gate.name: gate for gate in evaluate_gates(gate_inputs(report), cfg.registry)}["engine_acceptance[sglang]"]
    assert gate.status == "failed" and gate.waived_by is None


def test_a_waiver_needs_a_reason() -> None:
    with pytest.raises(ConfigError, match=r"registry\.waive_gates\.engine_acceptance: a waiver needs its reason"):
        load_config(None, ["registry.waive_gates={engine_acceptance: '  '}"])
    with pytest.raises(ConfigError, match=r"registry\.waive_gates: a waiver needs its reason"):
        load_config(None, ["registry.waive_gates=[engine_acceptance]"])
    with pytest.raises(ConfigError, match=r"unknown field 'agreement_waiver' in registry"):
        load_config(None, ["registry.agreement_waiver={reason: 'the old setting'}"])


# --- the typed reports ----------------------------------------------------------------------------------


def test_an_evaluate_report_with_a_renamed_field_fails_naming_the_file_and_the_field(tmp_path: Path) -> None:
    plant_offline(tmp_path, scripted_decodes())
    path = tmp_path / "evaluate" / "acceptance.json"
    report = json.loads(path.read_text())
    report["chain"]["per_prompt"][0]["tokens"] = report["chain"]["per_prompt"][0].pop("generated_tokens")
    del report["chain"]["mean_accept_length"]
    path.write_text(json.dumps(report))
    with pytest.raises(ReportError) as failure:
        load_report(AcceptanceReport, path, "evaluate")
    message = str(failure.value)
    assert message.startswith(f"{path} is not a AcceptanceReport as the evaluate stage writes it (rerun evaluate)")
    assert "chain.per_prompt[0].generated_tokens: Field required" in message
    assert "chain.per_prompt[0].tokens: Extra inputs are not permitted" in message
    assert "chain.mean_accept_length: Field required" in message
    for directory in ("target", "data/eval.jsonl"):
        (tmp_path / directory).mkdir(parents=True)
    with pytest.raises(ReportError, match="chain.mean_accept_length"):  # before any engine starts
        benchmark.check_inputs(RunConfig.model_validate({"output_dir": str(tmp_path),
                                                         "benchmark": {"engines": ["sglang"]}}))


def test_a_benchmark_report_with_a_renamed_field_fails_in_register_naming_it(tmp_path: Path) -> None:
    check = {"status": "ok", "check": "totals", "min_p_value": 0.5}
    report = benchmark_report({"sglang": engine_report(speedup_rows((1, 1.8)), check)})
    report["engines"]["sglang"]["agreement_check"] = report["engines"]["sglang"].pop("acceptance_check")
    path = tmp_path / "benchmark" / "report.json"
    path.parent.mkdir()
    path.write_text(json.dumps(report))
    with pytest.raises(ReportError, match=r"benchmark/report.json is not a BenchmarkReport (.|\n)*"
                                          r"engines\.sglang\.acceptance_check: Field required"):
        register.optional_serving(path)


# --- the flagship GPU recipe ----------------------------------------------------------------------------


def test_the_flagship_sglang_recipe_can_become_champion_on_the_totals_check(tmp_path: Path) -> None:
    """configs/llama31-8b-sglang.yaml from a scripted SGLang benchmark: every gate measurable, none waived."""
    cfg = load_config(FLAGSHIP, [f"output_dir={tmp_path}"])
    steps = cfg.evaluation.steps
    assert cfg.benchmark.engines == ["sglang"] and cfg.registry.waive_gates == {}, "measured, not waived"
    decodes = {ids: [min(steps + 1, length + 2) for length in lengths]
               for ids, lengths in scripted_decodes(prompts=12).items()}
    plant_offline(tmp_path, decodes, steps=steps, mean_accept_length=3.9)
    rows = [{"prompt": prompt_key(ids), "verify_rounds": rounds, "completion_tokens": emitted}
            for ids, (rounds, emitted) in ((ids, offline_decode(lengths, BUDGET)) for ids, lengths in decodes.items())]
    check = benchmark.check_agreement(cfg, "sglang", replayed(rows), steps=steps)
    speedups = speedup_rows((1, 2.3), (8, 1.9), (32, 1.4))
    report = BenchmarkReport.model_validate(benchmark_report({"sglang": engine_report(
        speedups, check, mean_accept_length=3.8, steps=steps)}))
    acceptance = load_report(AcceptanceReport, tmp_path / "evaluate" / "acceptance.json", "evaluate")
    gates = evaluate_gates(GateInputs(acceptance, report, {"passed": True, "violations": []}, "rev", "evalset", None),
                           cfg.registry)
    lines = [gate.describe() for gate in gates]
    print("\nflagship gates (configs/llama31-8b-sglang.yaml):\n  " + "\n  ".join(lines))
    assert [gate.name for gate in gates] == ["data_contract", "greedy_equivalence", "offline_accept_length",
                                             "serving_checks", "engine_acceptance[sglang]", "speedup[sglang]",
                                             "no_regression", "improvement"]
    assert all(gate.status == "passed" for gate in gates) and gates_passed(gates)
    assert check["check"] == "totals" and lines[4].startswith("engine_acceptance[sglang]: passed (measured 1, "
                                                              "threshold 0.01): p-value of tokens per verify round")
    assert lines[5].startswith("speedup[sglang]: passed (measured 2.3, threshold 1.5)")


def test_the_exact_agreement_fails_a_single_prompt_drafted_otherwise_that_the_rates_cannot_see() -> None:
    """registry.agreement_exact: one prompt of two accepting one token fewer at position 1 passes the per-position
    test's rates but fails the exact check, naming the prompt; equal rounds pass."""
    from tasks.benchmark import exact_check

    def row(prompt: str, rounds: int, accepted: list[float], offline_accepted: list[float]) -> dict[str, Any]:
        return {"prompt": prompt, "engine": {"drafts": rounds, "accepted_per_position": accepted},
                "offline": {"rounds": rounds, "accepted_per_position": offline_accepted}}

    alike = {"status": "ok", "per_prompt": [row("a", 9, [5, 2], [5, 2]), row("b", 8, [4, 1], [4, 1])]}
    exact_check(alike)
    assert alike["status"] == "ok" and alike["exact"] == {"prompts": 2, "differing": 0}
    otherwise = {"status": "ok", "per_prompt": [row("a", 9, [5, 2], [5, 2]), row("b", 8, [3, 1], [4, 1])]}
    exact_check(otherwise)
    assert otherwise["status"] == "failed" and otherwise["exact"]["differing"] == 1
    assert otherwise["reason"].startswith("1 of 2 prompts drafted otherwise than offline (registry.agreement_exact): "
                                          "b: engine 8 rounds accepting [3.0, 1.0], offline 8 accepting [4.0, 1.0]")
