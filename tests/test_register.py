"""register stage and registry commands on a real sqlite MLflow store and a real exported tiny drafter.

One drafter is trained for a few steps and evaluated once per module; each test copies what the stage reads
into its own output dir and plants the serving and data-contract reports and the offline accept length (good
ones, or one bad value, which is the point of a gate test). No engine runs here, so the copies waive the serving
gates unless a test says otherwise. The gates themselves are pure functions, checked one planted value at a time.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import typing
from pathlib import Path
from typing import Any, Callable, Optional

import mlflow
import pytest
import typer
from typer.testing import CliRunner

from contract.checkpoint import CheckpointContract, ContractMismatch
from pydantic import ValidationError

from contract.config import WAIVABLE_GATES, DraftConfig, RegistryConfig, RunConfig, TrackingConfig
from contract.config_loading import ConfigError, config_as_yaml, load_config
from contract.records import Message, PromptRecord, Provenance
from contract.reports import AcceptanceReport, BenchmarkReport
from flows.registry_cli import add_registry_commands
from tasks import evaluate, register, train
from tasks.registry import store as registry_store
from tasks.registry.comparison import SetComparison
from tasks.registry.gates import (NOT_RUN, Champion, GateInputs, blocking_lines, compare_with_champion, evaluate_gates,
                                  family_level, gates_passed, waivers_used)
from tasks.registry.promotion_lock import PromotionLocked, lock_path_for, promotion_lock
from report_builders import SKIPPED_BENCHMARK, acceptance_report, benchmark_report, engine_report, mode_acceptance, speedup_rows
from training_run import copied_run

MODEL = "tiny-drafter"
#: What the stage reads from a run; the rest (features, checkpoints) stays behind.
REGISTER_INPUTS = ("target.json", "target", "draft", "evaluate", "data/eval.jsonl")
#: The gates a run without a serving engine cannot measure.
SERVING_GATES = ["serving_checks", "engine_acceptance", "speedup"]
#: registry.waive_gates for them: each waiver with its reason.
SERVING_WAIVERS = {name: "no serving engine runs in these tests" for name in SERVING_GATES}


@pytest.fixture(scope="module")
def exported_run(tmp_path_factory: pytest.TempPathFactory, captured_tiny_run: RunConfig) -> RunConfig:
    """A drafter trained for two steps, exported for both engines, with a real offline evaluation."""
    cfg = copied_run(captured_tiny_run, tmp_path_factory.mktemp("register") / "run", max_steps=2)
    train.run(cfg)
    settings = {"steps": 3, "topk": 1, "max_new_tokens": 8, "max_prompts": 1}
    cfg = cfg.model_copy(update={"evaluation": cfg.evaluation.model_copy(update=settings)})
    evaluate.run(cfg)
    return cfg


def run_copy(exported: RunConfig, directory: Path, mlflow_uri: str, **registry: Any) -> RunConfig:
    """The stage's inputs in a fresh output dir, with good planted reports (no engine ran: the serving gates are
    waived unless `registry` says otherwise), tracked in `mlflow_uri`."""
    for name in REGISTER_INPUTS:
        source, destination = exported.output_path / name, directory / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, destination)
        else:
            shutil.copy2(source, destination)
    write(directory / "reports" / "data_contract.json", {"passed": True, "violations": []})
    (directory / "reports" / "data_docs").mkdir()
    (directory / "reports" / "data_docs" / "index.html").write_text("<html>data docs</html>")
    write(directory / "benchmark" / "report.json", {"skipped": "benchmark.engines is empty", "engines": {},
                                                    "failures": [], "passed": True})
    settings = {"model_name": MODEL, "waive_gates": SERVING_WAIVERS, **registry}
    cfg = exported.model_copy(update={
        "output_dir": str(directory),
        "tracking": TrackingConfig(enabled=True, tracking_uri=mlflow_uri, experiment="register-test"),
        "registry": RegistryConfig(**settings),
    })
    plant_accept_length(cfg, 2.0)  # a two-step drafter accepts next to nothing; the gates are what is tested
    return cfg


def write(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def plant_accept_length(cfg: RunConfig, value: float) -> None:
    """Overwrite the offline chain accept length of the run's evaluate report, and every prompt's rounds with it
    (each prompt accepts `value` tokens per round: the paired comparison with a champion is then exact)."""
    path = cfg.output_path / "evaluate" / "acceptance.json"
    report = json.loads(path.read_text())
    report["chain"]["mean_accept_length"] = value
    for row in report["chain"]["per_prompt"]:
        positions = len(row["accepted_per_position"])
        row["accepted_per_position"] = [(value - 1.0) * row["rounds"]] + [0.0] * (positions - 1)
    write(path, report)


def aliases(uri: str) -> dict[str, int]:
    return {alias: int(version) for alias, version in mlflow.MlflowClient(uri).get_registered_model(MODEL).aliases.items()}


# --- the gates, one planted value at a time -------------------------------------------------------------


def serving(speedup: float = 1.4, agreement: str = "ok", min_p_value: float = 0.4,
            failures: tuple[str, ...] = ()) -> dict[str, Any]:
    check = {"status": agreement, "check": "per_position", "offline_mean_accept_length": 2.0, "offline_steps": 3,
             "min_p_value": min_p_value, "engine_mean_accept_length": 2.1, "engine_steps": 3, "relative_gap": 0.05,
             "reason": "position 1: engine accepted 0/180 (0.0%), offline 8/226 (3.5%), p = 0.011"}
    engine = engine_report(speedup_rows((1, speedup), (4, 0.8)), check, failures=failures)
    return benchmark_report({"vllm": engine})


#: Eight reference prompts' spread around a report's τ (a prompt's τ is the report's plus its offset).
SPREAD = (-0.3, -0.2, -0.1, 0.0, 0.0, 0.1, 0.2, 0.3)


def prompt_rows(taus: list[float], source: Optional[str] = None, rounds: int = 20,
                prefix: str = "mtbench") -> list[dict[str, Any]]:
    """Per-prompt rows as evaluate writes them, prompt i accepting taus[i] tokens per round over `rounds` rounds."""
    return [{"prompt": f"{prefix}:{index}#turn1", "rounds": rounds, "source": source, "input_hash": f"{prefix}-{index}",
             "accepted_per_position": [(tau - 1.0) * rounds, 0.0, 0.0], "generated_tokens": int(tau * rounds)}
            for index, tau in enumerate(taus)]


def accept_length(value: float, suites: Optional[dict[str, list[float]]] = None, **changes: Any) -> dict[str, Any]:
    """An evaluate report whose chain accepts `value` tokens per round over eight prompts; `suites` adds the
    suites section, suite -> each prompt's τ."""
    chain = mode_acceptance(mean_accept_length=value, per_prompt=prompt_rows([value + offset for offset in SPREAD]))
    if suites is not None:
        rows = [row for name, taus in suites.items() for row in prompt_rows(taus, name, prefix=name)]
        changes["suites"] = mode_acceptance(per_prompt=rows)
    return acceptance_report(chain=chain, **changes)


def champion(value: float, fingerprint: str = "evalset", revision: str = "rev", **report: Any) -> Champion:
    """Champion v1 measured `value` on the reference prompts, with its logged acceptance report."""
    return Champion(1, revision, fingerprint, value, AcceptanceReport.model_validate(accept_length(value, **report)))


def good_inputs(**changes: Any) -> GateInputs:
    """Reports every gate passes on, with `changes` planted (reports as the JSON the stages write)."""
    values = {"acceptance": accept_length(2.0), "serving": serving(), "data_contract": {"passed": True, "violations": []},
              "target_revision": "rev", "eval_fingerprint": "evalset", "champion": champion(1.95)}
    values.update(changes)
    values["acceptance"] = AcceptanceReport.model_validate(values["acceptance"])
    values["serving"] = BenchmarkReport.model_validate(values["serving"]) if values["serving"] is not None else None
    return GateInputs(**values)


SETTINGS = RegistryConfig(min_accept_length=1.5, min_speedup=1.2, agreement_alpha=0.01, max_regression=0.02)
PLANTED: dict[str, tuple[Callable[[], GateInputs], Any, Any]] = {
    # gate: (inputs with one bad value, measured, threshold)
    "data_contract": (lambda: good_inputs(data_contract={"passed": False, "violations": ["ids unique"]}), False, True),
    "greedy_equivalence": (lambda: good_inputs(acceptance=accept_length(2.0, greedy_equivalence="failed")), "failed",
                           "passed"),
    "offline_accept_length": (lambda: good_inputs(acceptance=accept_length(1.4), champion=None), 1.4, 1.5),
    "serving_checks": (lambda: good_inputs(serving=serving(failures=("vllm: 1 of 8 requests failed",))), False, True),
    "engine_acceptance[vllm]": (lambda: good_inputs(serving=serving(agreement="failed", min_p_value=0.011)), 0.011,
                                0.01),
    "speedup[vllm]": (lambda: good_inputs(serving=serving(speedup=1.1)), 1.1, 1.2),
    "no_regression": (lambda: good_inputs(champion=champion(2.5)), 2.0, pytest.approx(2.45)),
}


def test_good_reports_pass_every_gate() -> None:
    gates = evaluate_gates(good_inputs(), SETTINGS)
    assert [gate.name for gate in gates] == ["data_contract", "greedy_equivalence", "offline_accept_length",
                                             "serving_checks", "engine_acceptance[vllm]", "speedup[vllm]", "no_regression",
                                             "improvement"]
    assert all(gate.status == "passed" for gate in gates) and gates_passed(gates)
    speedup = next(gate for gate in gates if gate.name == "speedup[vllm]")
    assert speedup.measured == 1.4 and "concurrency 1" in speedup.detail, "the lowest level by default"


@pytest.mark.parametrize("name", list(PLANTED))
def test_each_gate_fails_on_its_planted_bad_value(name: str) -> None:
    planted, measured, threshold = PLANTED[name]
    gates = {gate.name: gate for gate in evaluate_gates(planted(), SETTINGS)}
    assert gates[name].status == "failed", gates[name]
    assert (gates[name].measured, gates[name].threshold) == (measured, threshold)
    assert not gates_passed(list(gates.values()))
    assert name in gates[name].describe() and "threshold" in gates[name].describe()


def test_unmeasured_gates_block_champion_unless_waived_by_name() -> None:
    other_eval_set = champion(9.0, fingerprint="another-evalset")
    inputs = good_inputs(serving=SKIPPED_BENCHMARK, champion=other_eval_set)
    gates = evaluate_gates(inputs, SETTINGS)
    verdicts = {gate.name: gate.status for gate in gates}
    assert verdicts == {"data_contract": "passed", "greedy_equivalence": "passed", "offline_accept_length": "passed",
                        "serving_checks": "not run", "engine_acceptance": "not run", "speedup": "not run",
                        "no_regression": "not run", "improvement": "not run"}
    assert not gates_passed(gates), "nothing shows the drafter serves faster or does not regress"
    assert ("speedup: not run (measured None, threshold 1.2): no engine ran: benchmark.engines is empty; "
            "waive with registry.waive_gates: {speedup: <why it cannot be measured>}") in blocking_lines(gates)
    assert any("another eval set" in line and "{no_regression:" in line for line in blocking_lines(gates))

    serving_waived = evaluate_gates(inputs, waiving(SERVING_WAIVERS))
    assert {gate.name: gate.status for gate in serving_waived}["speedup"] == "waived"
    assert [gate.name for gate in serving_waived if gate.blocks] == ["no_regression", "improvement"], \
        "another eval set still blocks"
    assert "no eval set measured alike by this version and champion v1" in serving_waived[-1].detail
    rebuilt = {"no_regression": "the eval set was rebuilt", "improvement": "the eval set was rebuilt"}
    everything = waiving({**SERVING_WAIVERS, **rebuilt})
    waived = {gate.name: gate for gate in evaluate_gates(inputs, everything)}
    assert gates_passed(list(waived.values())) and waived["no_regression"].status == "waived"
    assert waived["no_regression"].waived_by == "registry.waive_gates.no_regression: the eval set was rebuilt"
    assert waived["speedup"].detail == "no engine ran: benchmark.engines is empty" and waived["speedup"].threshold == 1.2
    assert waived["speedup"].describe().endswith(
        "waived by registry.waive_gates.speedup: no serving engine runs in these tests")
    assert waivers_used(list(waived.values()), everything) == everything.waive_gates

    missing = {gate.name: gate for gate in evaluate_gates(good_inputs(data_contract=None), everything)}
    assert missing["data_contract"].failed and "validate stage" in missing["data_contract"].detail


#: Prompt-by-prompt changes whose mean is a drop of 0.1 but whose signs disagree: noise, not a regression.
NOISY_DROP = (0.6, -0.8, 0.6, -0.8, 0.6, -0.8, 0.6, -0.8)


def shifted(taus: list[float], changes: tuple[float, ...]) -> list[float]:
    return [tau + change for tau, change in zip(taus, changes)]


def test_a_drop_inside_the_noise_is_no_regression_and_a_gain_inside_it_does_not_replace_the_champion() -> None:
    base = [2.0 + offset for offset in SPREAD]
    noisy = accept_length(1.9, suites={"gsm8k": shifted(base, NOISY_DROP)})
    gates = {gate.name: gate for gate in evaluate_gates(
        good_inputs(acceptance=noisy, champion=champion(2.0, suites={"gsm8k": base})), SETTINGS)}
    suite = gates["no_regression[gsm8k]"]
    assert suite.status == "passed" and suite.measured == pytest.approx(1.9) and suite.threshold == pytest.approx(1.96)
    assert suite.detail.endswith("a drop inside the noise, not a regression"), suite.detail
    assert "difference -0.100 [" in suite.detail and "over 8 prompts" in suite.detail
    assert gates["no_regression"].status == "failed", "the reference prompts all dropped by 0.1: outside the noise"
    assert gates["improvement"].status == "failed" and "champion v1 stays" in gates["improvement"].detail

    gain = accept_length(2.0, suites={"gsm8k": shifted(base, tuple(-change for change in NOISY_DROP))})
    gates = {gate.name: gate for gate in evaluate_gates(
        good_inputs(acceptance=gain, champion=champion(2.0, suites={"gsm8k": base})), SETTINGS)}
    assert gates["no_regression"].status == gates["no_regression[gsm8k]"].status == "passed"
    improvement = gates["improvement"]
    assert improvement.status == "failed" and improvement.measured == 0.0, "the best lower bound: the equal reference"
    assert gates["no_regression[gsm8k]"].measured == pytest.approx(2.1)
    assert "a gain inside the noise does not replace it" in improvement.detail
    assert "gsm8k: 2.100 vs champion 2.000, difference +0.100" in improvement.detail
    assert not gates_passed(list(gates.values()))


def test_each_suite_is_gated_on_its_own_prompts() -> None:
    suites = {"mtbench": [1.5] * 8, "gsm8k": [1.8] * 8}
    candidate = accept_length(2.0, suites={"mtbench": [1.7] * 8, "gsm8k": [1.6] * 8})
    gates = {gate.name: gate for gate in evaluate_gates(
        good_inputs(acceptance=candidate, champion=champion(1.95, suites=suites)), SETTINGS)}
    assert [name for name in gates if name.startswith("no_regression")] == [
        "no_regression", "no_regression[mtbench]", "no_regression[gsm8k]"]
    regressed = gates["no_regression[gsm8k]"]
    assert regressed.status == "failed" and regressed.measured == pytest.approx(1.6)
    assert regressed.threshold == pytest.approx(1.8 * 0.98) and "difference -0.200 [-0.200, -0.200]" in regressed.detail
    assert gates["no_regression[mtbench]"].status == "passed"
    assert gates["improvement"].status == "passed" and gates["improvement"].measured == pytest.approx(0.2)
    assert gates["improvement"].detail.startswith("mtbench gains beyond the noise")
    assert blocking_lines(list(gates.values())) == [regressed.describe()]

    other_prompts = champion(1.95, suites={"mtbench": [1.5] * 8, "gsm8k": [1.8] * 9})
    first = {gate.name: gate for gate in evaluate_gates(good_inputs(acceptance=candidate, champion=None), SETTINGS)}
    assert first["no_regression[gsm8k]"].status == "passed" and "no champion yet" in first["no_regression[gsm8k]"].detail
    unlike = {gate.name: gate for gate in evaluate_gates(
        good_inputs(acceptance=candidate, champion=other_prompts), SETTINGS)}
    assert unlike["no_regression[gsm8k]"].status == NOT_RUN
    assert unlike["no_regression[gsm8k]"].detail == ("champion v1: measured on other prompts (8 of the candidate's 8 "
                                                      "prompts and the champion's 9 are the same)")
    assert unlike["no_regression[mtbench]"].status == "passed"


def served_with_suites(suites: dict[str, list[float]], unit: str = "prompts") -> dict[str, Any]:
    """A passing vLLM benchmark whose engine replayed `suites` (evaluation.sets_on: engine), suite -> each unit's τ."""
    rows = [row for name, taus in suites.items() for row in prompt_rows(taus, name, prefix=name)]
    rounds = sum(row["rounds"] for row in rows)
    replayed = {"engine": "vllm", "steps": 3, "max_new_tokens": 32, "temperature": 0.0, "concurrency": 1, "unit": unit,
                "prompts": len(rows), "rounds": rounds, "mean_accept_length": 2.0,
                "mean_accept_length_interval": {"low": 1.9, "high": 2.1, "prompts": len(rows)},
                "acceptance_by_position": [0.5, 0.3, 0.2], "accepted_per_position": [1.0, 1.0, 1.0], "buckets": {},
                "per_prompt": rows, "generated_tokens": 100, "seconds": 10.0, "tokens_per_second": 10.0}
    report = serving()
    report["engines"]["vllm"]["suites"] = replayed
    return report


def test_suites_measured_on_the_engine_are_gated_against_the_champions_engine_suites() -> None:
    champion_suites = {"mtbench": [1.5] * 8, "gsm8k": [1.8] * 8}
    engine_champion = Champion(1, "rev", "evalset", 1.95, AcceptanceReport.model_validate(accept_length(1.95)),
                               BenchmarkReport.model_validate(served_with_suites(champion_suites)))
    candidate = served_with_suites({"mtbench": [1.7] * 8, "gsm8k": [1.6] * 8})
    gates = {gate.name: gate for gate in evaluate_gates(good_inputs(serving=candidate, champion=engine_champion),
                                                        SETTINGS)}
    assert gates["no_regression[gsm8k]"].status == "failed" and gates["no_regression[mtbench]"].status == "passed"
    assert "both by the vllm engine" in gates["no_regression[gsm8k]"].detail
    assert gates["improvement"].status == "passed", "the reference prompts gained 0.05 on every prompt"

    offline_champion = champion(1.95, suites=champion_suites)
    gates = {gate.name: gate for gate in evaluate_gates(good_inputs(serving=candidate, champion=offline_champion),
                                                        SETTINGS)}
    assert gates["no_regression[gsm8k]"].status == NOT_RUN
    assert gates["no_regression[gsm8k]"].detail == (
        "champion v1: measured otherwise (measured by vllm engine vs offline decoder)")
    grouped = served_with_suites({"mtbench": [1.7] * 8, "gsm8k": [1.6] * 8}, unit="groups of up to 4 prompts")
    gates = {gate.name: gate for gate in evaluate_gates(good_inputs(serving=grouped, champion=engine_champion),
                                                        SETTINGS)}
    assert "unit groups of up to 4 prompts vs prompts" in gates["no_regression[mtbench]"].detail


def test_a_champion_without_readable_rounds_or_prompt_hashes() -> None:
    unreadable = Champion(1, "rev", "evalset", 1.95)
    gates = {gate.name: gate for gate in evaluate_gates(good_inputs(champion=unreadable), SETTINGS)}
    assert gates["no_regression"].status == "passed" and "point comparison" in gates["no_regression"].detail
    assert gates["improvement"].status == NOT_RUN
    assert gates["improvement"].detail == "champion v1's reports/acceptance.json could not be read: nothing to pair"

    unhashed = accept_length(1.95, suites={"gsm8k": [1.5] * 8})
    for row in unhashed["chain"]["per_prompt"] + unhashed["suites"]["per_prompt"]:
        del row["input_hash"]
    before_hashes = Champion(1, "rev", "evalset", 1.95, AcceptanceReport.model_validate(unhashed))
    candidate = accept_length(2.0, suites={"gsm8k": [1.6] * 8})
    gates = {gate.name: gate for gate in evaluate_gates(
        good_inputs(acceptance=candidate, champion=before_hashes), SETTINGS)}
    assert gates["improvement"].status == "passed", "the reference prompts pair on their names"
    assert gates["improvement"].detail.startswith("reference gains beyond the noise")
    assert gates["no_regression[gsm8k]"].status == NOT_RUN and "no prompt hashes" in gates["no_regression[gsm8k]"].detail


#: Per-prompt gains whose 95 % paired interval over the eight prompts just clears zero: one set like it is evidence,
#: one of seven sets like it is what noise alone produces about one time in six.
MARGINAL_GAIN = (0.3, 0.25, 0.2, 0.15, 0.1, 0.05, -0.05, -0.1)


def test_the_improvement_gate_corrects_for_reading_several_sets() -> None:
    base = [2.0 + offset for offset in SPREAD]
    names = [f"suite{index}" for index in range(6)]
    marginal = {name: shifted(base, MARGINAL_GAIN[index:] + MARGINAL_GAIN[:index]) for index, name in enumerate(names)}
    the_champion = champion(2.0, suites={name: base for name in names})
    inputs = good_inputs(acceptance=accept_length(2.0, suites=marginal), champion=the_champion)
    uncorrected = compare_with_champion(inputs).suites
    assert all(isinstance(uncorrected[name], SetComparison) and uncorrected[name].significant_gain for name in names), \
        "each suite alone clears zero at 95 %"
    improvement = {gate.name: gate for gate in evaluate_gates(inputs, SETTINGS)}["improvement"]
    assert improvement.status == "failed" and improvement.measured <= 0.0, improvement.describe()
    corrected = family_level(7)
    assert corrected == pytest.approx(1.0 - 0.05 / 7)
    assert f"at {corrected:.2%} confidence, Bonferroni over 7 sets" in improvement.detail
    widened = [uncorrected[name].difference_at(corrected, 4000 * 7) for name in names]
    assert all(interval.low <= 0.0 < uncorrected[name].difference.low for name, interval in zip(names, widened))

    really = {**marginal, "suite5": shifted(base, (0.3,) * 8)}
    gates = {gate.name: gate for gate in evaluate_gates(
        good_inputs(acceptance=accept_length(2.0, suites=really), champion=the_champion), SETTINGS)}
    assert gates["improvement"].status == "passed" and gates["improvement"].measured == pytest.approx(0.3)
    assert gates["improvement"].detail.startswith("suite5 gains beyond the noise")


def test_the_reference_prompts_pair_on_their_names_when_the_eval_fingerprints_agree() -> None:
    """A later turn's token ids hold the earlier turns' regenerated replies: two runs of one recipe hash them
    differently, and the fingerprint of the prompts (equal here) is what vouches for the pairing."""
    regenerated = accept_length(2.0)
    for row in regenerated["chain"]["per_prompt"][::2]:
        row["input_hash"] = "another history"
    gates = {gate.name: gate for gate in evaluate_gates(good_inputs(acceptance=regenerated,
                                                                    champion=champion(2.1)), SETTINGS)}
    regression = gates["no_regression"]
    assert regression.status == "failed" and "paired reference: 2.000 vs champion 2.100" in regression.detail
    assert "difference -0.100 [-0.100, -0.100] over 8 prompts" in regression.detail


def waiving(waivers: dict[str, str]) -> RegistryConfig:
    """SETTINGS with `waivers` as registry.waive_gates, validated as a config would be."""
    return RegistryConfig(**{**SETTINGS.model_dump(), "waive_gates": waivers})


def test_a_waiver_never_overrules_a_measured_gate() -> None:
    settings = waiving({name: "any" for name in WAIVABLE_GATES})
    gates = {gate.name: gate for gate in evaluate_gates(good_inputs(serving=serving(speedup=1.1)), settings)}
    assert gates["speedup[vllm]"].status == "failed" and not gates_passed(list(gates.values()))
    assert waivers_used(list(gates.values()), settings) == {}, "a waiver that let nothing through is not recorded"


def test_a_skipped_engine_comparison_is_waived_by_its_family_name() -> None:
    report = serving()
    report["engines"]["vllm"]["acceptance_check"] = {"status": "skipped", "reason": "temperature > 0"}
    gate = {gate.name: gate for gate in evaluate_gates(good_inputs(serving=report), SETTINGS)}["engine_acceptance[vllm]"]
    assert gate.status == "not run" and gate.blocks and "registry.waive_gates: {engine_acceptance:" in gate.describe()
    settings = waiving({"engine_acceptance": "sampled at temperature 0.7"})
    gates = evaluate_gates(good_inputs(serving=report), settings)
    assert gates_passed(gates) and waivers_used(gates, settings) == {"engine_acceptance": "sampled at temperature 0.7"}


def test_an_inconclusive_agreement_is_a_gate_that_could_not_be_measured_never_a_pass() -> None:
    report = serving(agreement="inconclusive", min_p_value=0.9)
    report["engines"]["vllm"]["acceptance_check"]["reason"] = "too few drafts to tell: engine 12, offline 14 rounds"
    gate = {gate.name: gate for gate in evaluate_gates(good_inputs(serving=report), SETTINGS)}["engine_acceptance[vllm]"]
    assert gate.status == "not run" and gate.blocks and "inconclusive: too few drafts to tell" in gate.detail


def test_every_gate_that_can_go_unmeasured_can_be_waived() -> None:
    other_revision = Champion(1, "another-rev", "evalset", 1.9)
    unmeasured = evaluate_gates(good_inputs(serving=SKIPPED_BENCHMARK, champion=other_revision), SETTINGS)
    assert {gate.family for gate in unmeasured if gate.status == NOT_RUN} == set(WAIVABLE_GATES)
    regression = {gate.name: gate for gate in unmeasured}["no_regression"]
    assert "another target revision" in regression.detail


def test_the_first_version_has_nothing_to_regress_against() -> None:
    gates = {gate.name: gate for gate in evaluate_gates(good_inputs(champion=None), SETTINGS)}
    assert gates["no_regression"].status == "passed" and gates["no_regression"].measured == 2.0
    assert gates["no_regression"].detail == "no champion yet: nothing to regress against"
    assert gates_passed(list(gates.values()))


def test_the_accept_length_floor_defaults_above_nothing_accepted() -> None:
    settings = RegistryConfig()
    assert settings.min_accept_length > 1.0 and settings.waive_gates == {}
    nothing_accepted = accept_length(1.0)
    gates = {gate.name: gate for gate in evaluate_gates(good_inputs(acceptance=nothing_accepted, champion=None),
                                                        settings)}
    assert gates["offline_accept_length"].status == "failed", "1.0 is every drafted token rejected"
    with pytest.raises(ValidationError, match="min_accept_length"):
        RegistryConfig(min_accept_length=1.0)
    with pytest.raises(ConfigError, match=r"registry\.min_accept_length: Input should be greater than 1"):
        load_config(None, ["registry.min_accept_length=1.0"])


def test_waive_gates_takes_only_gates_that_can_go_unmeasured() -> None:
    override = "registry.waive_gates={speedup: 'no engine in CI', no_regression: '  eval set rebuilt '}"
    assert load_config(None, [override]).registry.waive_gates == {"speedup": "no engine in CI",
                                                                  "no_regression": "eval set rebuilt"}
    for name in ("sped_up", "speedup[vllm]", "data_contract"):
        with pytest.raises(ConfigError, match=r"registry\.waive_gates: unknown gate\(s\) .*serving_checks, "
                                              r"engine_acceptance, speedup, no_regression"):
            load_config(None, [f"registry.waive_gates={{'{name}': 'why'}}"])


@pytest.mark.parametrize("override", ["{speedup: '  '}", "{speedup: ''}", "{speedup: }", "{speedup: null}"])
def test_a_waiver_without_its_reason_is_refused_naming_the_field(override: str) -> None:
    with pytest.raises(ConfigError, match=r"registry\.waive_gates\.speedup: a waiver needs its reason"):
        load_config(None, [f"registry.waive_gates={override}"])


def test_the_old_list_of_waived_gates_is_refused_with_the_mapping_to_write() -> None:
    with pytest.raises(ConfigError, match=r"registry\.waive_gates: a waiver needs its reason: map each gate to why "
                                          r"it cannot be measured, e.g. \{speedup: '<why>', no_regression: '<why>'\}"):
        load_config(None, ["registry.waive_gates=[speedup, no_regression]"])



# --- the stage ------------------------------------------------------------------------------------------


def git_repo_with_lock(directory: Path) -> str:
    """A committed git repo holding a dvc.lock; returns HEAD."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = {"schema": "2.0", "stages": {"train": {"cmd": "eaglet stage train", "outs": [{"md5": "abc"}]},
                                        "register": {"cmd": "eaglet stage register"}}}
    (directory / "dvc.lock").write_text(json.dumps(lock))
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    for command in (["init", "-q"], ["add", "dvc.lock"], ["commit", "-q", "-m", "lock"]):
        subprocess.run(git + command, cwd=directory, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True).stdout.strip()


@pytest.mark.integration  # the stage asks git for the commit
def test_registration_carries_the_contract_reports_and_provenance(exported_run: RunConfig, tmp_path: Path,
                                                                  mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = run_copy(exported_run, tmp_path / "out", mlflow_uri)
    head = git_repo_with_lock(tmp_path / "repo")
    monkeypatch.chdir(tmp_path / "repo")
    result = register.run(cfg)

    registration = json.loads((cfg.output_path / "register" / "registration.json").read_text())
    assert registration == result.registration and registration["version"] == 1
    assert registration["aliases"] == ["champion"] and registration["gates_passed"] is True
    lock = Path(mlflow_uri.removeprefix("sqlite:///")).resolve().with_name(f"mlflow.db.{MODEL}.promotion.lock")
    assert registration["promotion_guard"] == f"file lock {lock}" and registration["promotion_refused"] is None
    assert {gate["name"]: gate["status"] for gate in registration["gates"]}["speedup"] == "waived"
    assert registration["waived_gates"] == SERVING_GATES and registration["failed_gates"] == []
    assert registration["waivers"] == SERVING_WAIVERS
    assert result.summary() == {"registered": 1.0, "version": 1.0, "gates_passed": 1.0, "gates_failed": 0.0,
                                "champion": 1.0, "offline_accept_length": registration["offline_accept_length"]}

    client = mlflow.MlflowClient(mlflow_uri)
    version = client.get_model_version(MODEL, "1")
    contract = CheckpointContract.model_validate_json((cfg.output_path / "draft" / "sglang" / "contract.json").read_text())
    for field, value in contract.model_dump(mode="json").items():
        if field not in ("engine", "evaluation"):
            assert version.tags[f"contract.{field}"] == register.tag_value(value), field
    assert version.tags["contract.target_revision"] == json.loads((cfg.output_path / "target.json").read_text())["revision"]
    assert json.loads(version.tags["contract.evaluation"])["offline"]["greedy_equivalence"] == "passed"
    assert version.tags["eaglet.git_commit"] == head and version.tags["eaglet.git_dirty"] == "false"
    assert version.tags["eaglet.dvc_lock_hash"] == registration["dvc_lock_hash"] != "none"
    lock = json.loads((tmp_path / "repo" / "dvc.lock").read_text())
    lock["stages"]["register"]["cmd"] = "changed"
    (tmp_path / "repo" / "dvc.lock").write_text(json.dumps(lock))
    assert register.dvc_lock_hash(tmp_path / "repo") == registration["dvc_lock_hash"], "only upstream stages count"
    assert register.dvc_lock_hash(tmp_path) == "none" and register.git_commit(tmp_path) == "unknown"
    assert version.tags["eaglet.data_docs"].endswith("reports/data_docs/index.html")
    assert version.tags["eaglet.eval_fingerprint"] == registration["eval_fingerprint"]
    assert version.tags["eaglet.recommended_serving"] == "not measured"
    assert json.loads(version.tags["eaglet.waivers"]) == SERVING_WAIVERS

    model = client.get_logged_model(registration["model_id"])
    assert version.source == f"models:/{model.model_id}" and model.status.to_proto() == 2  # READY
    assert client.get_run(version.run_id).data.tags["eaglet.stage"] == "register", "its own run outside a pipeline"
    fetched = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{MODEL}/1", dst_path=str(tmp_path / "all"),
                                                       tracking_uri=mlflow_uri))
    files = {str(path.relative_to(fetched)) for path in fetched.rglob("*") if path.is_file()}
    assert {"contract.json", "reports/acceptance.json", "reports/serving.json", "reports/data_contract.json",
            "sglang/model.safetensors", "vllm/config.json"} <= files
    assert model.artifact_location.startswith((tmp_path / "mlartifacts").as_uri()), "beside the store, not in the cwd"


@pytest.mark.integration  # the stage asks git for the commit
def test_failing_gate_keeps_candidate_then_a_passing_version_moves_the_aliases(
        exported_run: RunConfig, tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = run_copy(exported_run, tmp_path / "out", mlflow_uri, min_accept_length=1.5)
    plant_accept_length(cfg, 2.0)
    register.run(cfg)
    plant_accept_length(cfg, 1.2)
    failed = register.run(cfg)

    assert failed.registration["version"] == 2 and failed.registration["aliases"] == ["candidate"]
    assert aliases(mlflow_uri) == {"champion": 1, "candidate": 2}
    gates = {gate["name"]: gate for gate in failed.registration["gates"]}
    assert gates["offline_accept_length"] == {"name": "offline_accept_length", "status": "failed", "measured": 1.2,
                                              "threshold": 1.5, "detail": "registry.min_accept_length not reached"}
    assert gates["no_regression"]["status"] == "failed" and gates["no_regression"]["threshold"] == pytest.approx(1.96)
    assert "v1" in gates["no_regression"]["detail"]
    assert any(line.startswith("offline_accept_length: failed (measured 1.2, threshold 1.5)")
               for line in failed.registration["failed_gates"])
    assert gates["improvement"]["status"] == "failed" and gates["improvement"]["measured"] == pytest.approx(-0.8), \
        "paired with the champion's logged per-prompt rounds"
    assert failed.summary()["gates_failed"] == 3.0 and failed.summary()["champion"] == 0.0

    plant_accept_length(cfg, 2.2)
    mlflow.set_tracking_uri(mlflow_uri)
    mlflow.set_experiment("register-test")
    with mlflow.start_run(run_name="pipeline") as pipeline_run:
        passed = register.run(cfg)
    assert passed.registration["mlflow_run_id"] == pipeline_run.info.run_id, "inside the pipeline's run"
    assert passed.registration["previous_champion"] == 1 and passed.registration["champion_before"] == 1
    assert aliases(mlflow_uri) == {"champion": 3, "previous": 1}


@pytest.mark.integration  # the stage asks git for the commit
def test_an_unmeasured_gate_withholds_champion_until_the_config_waives_it(
        exported_run: RunConfig, tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.cli import champion_line

    monkeypatch.chdir(tmp_path)
    strict = run_copy(exported_run, tmp_path / "out", mlflow_uri, waive_gates={})
    held_back = register.run(strict).registration
    assert held_back["version"] == 1 and held_back["aliases"] == ["candidate"] and not held_back["gates_passed"]
    assert aliases(mlflow_uri) == {"candidate": 1}, "registered all the same"
    verdicts = {gate["name"]: gate["status"] for gate in held_back["gates"]}
    assert verdicts["no_regression"] == "passed", "the first version has nothing to regress against"
    assert [line.partition(":")[0] for line in held_back["failed_gates"]] == SERVING_GATES
    assert held_back["failed_gates"][0].startswith("serving_checks: not run (measured None, threshold True): no engine ran")
    line = champion_line(strict, held_back)
    assert f"models:/{MODEL}@champion = none yet; this run's version 1 stays candidate (serving_checks: not run" in line
    assert "speedup: not run" in line and "waive with registry.waive_gates: {speedup: " in line

    waived = run_copy(exported_run, tmp_path / "out-waived", mlflow_uri)
    promoted = register.run(waived).registration
    assert promoted["aliases"] == ["champion"] and promoted["waived_gates"] == SERVING_GATES
    assert champion_line(waived, promoted) == (f"models:/{MODEL}@champion = version 2 (this run; waived: "
                                               "serving_checks, engine_acceptance, speedup)")

    acceptance_path = waived.output_path / "evaluate" / "acceptance.json"
    acceptance = json.loads(acceptance_path.read_text())
    write(acceptance_path, {**acceptance, "max_new_tokens": acceptance["max_new_tokens"] + 1})
    incomparable = register.run(waived).registration
    assert incomparable["eval_fingerprint"] != promoted["eval_fingerprint"]
    assert incomparable["aliases"] == ["candidate"] and aliases(mlflow_uri) == {"champion": 2, "candidate": 3}
    assert [line.partition(":")[0] for line in incomparable["failed_gates"]] == ["no_regression", "improvement"]
    assert "champion v2 was evaluated on another eval set" in incomparable["failed_gates"][0]

    config = tmp_path / "run.yaml"
    config.write_text(config_as_yaml(waived))
    refused = invoke("promote", "--version", "3", "--config", str(config))
    assert refused.exit_code == 1 and "no_regression: not run" in refused.output
    shown = invoke("registry", "show", "--config", str(config))
    assert shown.exit_code == 0, shown.output
    header, rows = table_cells(shown.output)
    assert rows["2"][header.index("method")] == "eagle3", "the method tag (contract.method)"
    waived_column = header.index("waived gates")
    assert rows["2"][waived_column] == "serving_checks, engine_acceptance, speedup"
    assert rows["1"][waived_column] == "none" and rows["3"][waived_column] == "serving_checks, engine_acceptance, speedup"


@pytest.mark.integration  # the stage asks git for the commit
def test_a_waived_gate_carries_its_reason_into_registration_and_the_version_tag(
        exported_run: RunConfig, tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An SGLang benchmark whose agreement measured nothing: blocked without a waiver, champion with one, whose
    reason the version keeps."""
    monkeypatch.chdir(tmp_path)
    unmeasured = {"status": "skipped", "reason": "sglang: no agreement run at evaluation.steps 3"}
    report = benchmark_report({"sglang": engine_report(speedup_rows((1, 1.5)), unmeasured)})
    strict = run_copy(exported_run, tmp_path / "out", mlflow_uri, waive_gates={})
    write(strict.output_path / "benchmark" / "report.json", report)
    held_back = register.run(strict).registration
    assert held_back["aliases"] == ["candidate"] and held_back["waivers"] == {}
    assert [line.partition(":")[0] for line in held_back["failed_gates"]] == ["engine_acceptance[sglang]"]
    assert "registry.waive_gates: {engine_acceptance: " in held_back["failed_gates"][0]

    reason = "this SGLang build reports no spec_verify_ct"
    waivers = {"engine_acceptance": reason, "speedup": "measured here, so this waiver lets nothing through"}
    waived = run_copy(exported_run, tmp_path / "out-waived", mlflow_uri, waive_gates=waivers)
    write(waived.output_path / "benchmark" / "report.json", report)
    promoted = register.run(waived).registration
    assert promoted["aliases"] == ["champion"] and promoted["waived_gates"] == ["engine_acceptance[sglang]"]
    gate = {gate["name"]: gate for gate in promoted["gates"]}["engine_acceptance[sglang]"]
    assert gate["status"] == "waived" and gate["waived_by"] == f"registry.waive_gates.engine_acceptance: {reason}"
    assert promoted["waivers"] == {"engine_acceptance": reason}, "only the waivers that let a gate through"
    client = mlflow.MlflowClient(mlflow_uri)
    assert json.loads(client.get_model_version(MODEL, str(promoted["version"])).tags["eaglet.waivers"]) == {
        "engine_acceptance": reason}
    assert json.loads(client.get_model_version(MODEL, "1").tags["eaglet.waivers"]) == {}


def table_cells(output: str) -> tuple[list[str], dict[str, list[str]]]:
    """`registry show`'s header and its rows by version, as stripped cells (one line per row at COLUMNS=220)."""
    lines = [line.replace("┃", "│") for line in output.splitlines()]  # the header row's rule is heavy
    table = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.count("│") >= 8]
    return table[0], {cells[0]: cells for cells in table[1:]}


def test_missing_inputs_fail_naming_the_file_and_the_stage(exported_run: RunConfig, tmp_path: Path, mlflow_uri: str) -> None:
    cfg = run_copy(exported_run, tmp_path / "out", mlflow_uri)
    (cfg.output_path / "evaluate" / "acceptance.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"evaluate/acceptance.json: run the evaluate stage"):
        register.run(cfg)
    (cfg.output_path / "draft" / "vllm" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"draft/vllm/model.safetensors: run the train stage"):
        register.run(cfg)
    assert not (cfg.output_path / "register").exists()


@pytest.mark.integration  # the stage asks git for the commit
def test_without_tracking_the_gates_are_reported_and_nothing_is_registered(exported_run: RunConfig, tmp_path: Path,
                                                                          mlflow_uri: str) -> None:
    cfg = run_copy(exported_run, tmp_path / "out", mlflow_uri, min_accept_length=9.0)
    cfg = cfg.model_copy(update={"tracking": TrackingConfig(enabled=False)})
    result = register.run(cfg)
    assert result.registration["version"] is None and "tracking.enabled is false" in result.registration["skipped"]
    assert result.registration["failed_gates"][0].startswith("offline_accept_length: failed")
    assert result.summary()["registered"] == 0.0 and "version" not in result.summary()
    assert not (cfg.output_path / "mlflow.db").exists()


def held_out_record(record_id: str, question: str, replies: tuple[str, str]) -> str:
    """A two-turn held-out record as validate writes it to data/eval.jsonl, its assistant turns holding `replies`."""
    messages = [Message(role="system", content="Be brief."), Message(role="user", content=question),
                Message(role="assistant", content=replies[0], reasoning_content=f"thinking about {replies[0]}",
                        supervised=True),
                Message(role="user", content="And why?"),
                Message(role="assistant", content=replies[1], supervised=True)]
    record = PromptRecord(id=record_id, source="mtbench", messages=messages, split="eval",
                          provenance=Provenance(file="mtbench.jsonl", line=1, format="jsonl"))
    return record.model_dump_json()


def test_the_eval_fingerprint_counts_the_prompts_not_the_regenerated_replies(tmp_path: Path) -> None:
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path)})
    acceptance = AcceptanceReport.model_validate(accept_length(2.0))
    eval_set = tmp_path / "data" / "eval.jsonl"
    eval_set.parent.mkdir(parents=True)

    def fingerprint(*records: str) -> str:
        eval_set.write_text("\n".join(records) + "\n")
        return register.eval_fingerprint(cfg, acceptance)

    first_run = fingerprint(held_out_record("mtbench:1", "Name a prime.", ("7.", "It has two divisors.")),
                            held_out_record("mtbench:2", "Name a colour.", ("Red.", "It came to mind.")))
    rerun = fingerprint(held_out_record("mtbench:1", "Name a prime.", ("Eleven.", "Only 1 and 11 divide it.")),
                        held_out_record("mtbench:2", "Name a colour.", ("Blue, the sky's.", "Look up.")))
    assert rerun == first_run, "the replies are regenerated each run: the same prompts are the same eval set"
    other_question = fingerprint(held_out_record("mtbench:1", "Name an even prime.", ("2.", "Only 1 and 2 divide it.")),
                                 held_out_record("mtbench:2", "Name a colour.", ("Red.", "It came to mind.")))
    assert other_question != first_run
    fewer = fingerprint(held_out_record("mtbench:1", "Name a prime.", ("7.", "It has two divisors.")))
    assert fewer not in (first_run, other_question)

    gates = {gate.name: gate for gate in evaluate_gates(
        good_inputs(eval_fingerprint=rerun, champion=champion(1.95, fingerprint=first_run)), SETTINGS)}
    assert gates["no_regression"].status == "passed" and "paired reference" in gates["no_regression"].detail


def registry_with_versions(uri: str, count: int, source: Path) -> Any:
    """A registered model with `count` versions in the sqlite store at `uri` (their `source` is never read)."""
    client = mlflow.MlflowClient(uri)
    client.create_registered_model(MODEL)
    for _ in range(count):
        client.create_model_version(MODEL, source=str(source))
    return client


def test_a_champion_that_moved_after_the_comparison_is_not_replaced(mlflow_uri: str, tmp_path: Path) -> None:
    """Compare-and-set, the guard where no lock file is shared: v2 and v3 were both gated against v1; v3 moved the
    alias first, so v2 (never compared with v3) stays candidate and records why."""
    client = registry_with_versions(mlflow_uri, 3, tmp_path)
    assert registry_store.promote_if_unchanged(client, MODEL, 1, None) == registry_store.Promotion(True)
    gated_against = registry_store.alias_version(client, MODEL, "champion")
    client.set_registered_model_alias(MODEL, "candidate", "2")
    assert registry_store.promote_if_unchanged(client, MODEL, 3, gated_against) == registry_store.Promotion(True, 1)
    late = registry_store.promote_if_unchanged(client, MODEL, 2, gated_against)
    assert not late.promoted and late.previous is None
    assert late.refused is not None and late.refused.startswith("champion moved from v1 to v3 after v2 was gated")
    assert aliases(mlflow_uri) == {"champion": 3, "previous": 1, "candidate": 2}
    assert client.get_model_version(MODEL, "2").tags["eaglet.promotion_refused"] == late.refused


def test_promotions_into_one_registry_take_turns_under_its_lock(mlflow_uri: str, tmp_path: Path) -> None:
    """Two runs promoting at once, each reading the champion, gating, then moving the alias: under the lock the
    second reads the champion the first left, so it is compared with it instead of replacing it unseen."""
    registry_with_versions(mlflow_uri, 2, tmp_path)
    events: list[tuple[str, int, Optional[int]]] = []
    guards: list[str] = []
    start = threading.Barrier(2)

    def promote(version: int) -> None:
        client = mlflow.MlflowClient(mlflow_uri)
        start.wait()
        with promotion_lock(mlflow_uri, MODEL) as guard:
            guards.append(guard.kind)
            seen = registry_store.alias_version(client, MODEL, "champion")
            events.append(("read", version, seen))
            time.sleep(0.3)  # the comparison with the champion just read
            outcome = registry_store.promote_if_unchanged(client, MODEL, version, seen)
            events.append(("moved" if outcome.promoted else "refused", version, seen))

    threads = [threading.Thread(target=promote, args=(version,)) for version in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    first, second = events[0][1], events[2][1]
    assert events == [("read", first, None), ("moved", first, None), ("read", second, first),
                      ("moved", second, first)], "the second read the champion only after the first moved it"
    assert guards == ["file lock", "file lock"], "a sqlite store is on this machine"
    database = Path(mlflow_uri.removeprefix("sqlite:///")).resolve()
    assert lock_path_for(mlflow_uri, "team/drafter") == database.with_name("mlflow.db.team_drafter.promotion.lock")

    with promotion_lock(mlflow_uri, MODEL):
        waiting: list[BaseException] = []
        thread = threading.Thread(target=lambda: held_too_long(mlflow_uri, waiting))
        thread.start()
        thread.join(timeout=30)
    assert len(waiting) == 1 and isinstance(waiting[0], PromotionLocked)
    assert f"holds {database.with_name(f'mlflow.db.{MODEL}.promotion.lock')}" in str(waiting[0])
    with promotion_lock("https://mlflow.example.com", MODEL) as remote:
        assert remote.kind == "compare-and-set" and remote.lock_path is None


def held_too_long(uri: str, errors: list[BaseException]) -> None:
    """Try to take the promotion lock another thread holds, waiting a fifth of a second; keep what was raised."""
    try:
        with promotion_lock(uri, MODEL, wait_s=0.2):
            pass
    except PromotionLocked as error:
        errors.append(error)


# --- the commands ---------------------------------------------------------------------------------------


def cli() -> typer.Typer:
    app = typer.Typer()
    add_registry_commands(app)
    return app


def invoke(*arguments: str) -> Any:
    return CliRunner().invoke(cli(), list(arguments), env={"COLUMNS": "220"})


@pytest.mark.integration  # the stage asks git for the commit
def test_promote_needs_passed_gates_or_force_with_a_reason_and_show_lists_versions(
        exported_run: RunConfig, tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = run_copy(exported_run, tmp_path / "out", mlflow_uri, min_accept_length=1.5)
    config = tmp_path / "run.yaml"
    config.write_text(config_as_yaml(cfg))
    plant_accept_length(cfg, 2.0)
    register.run(cfg)
    plant_accept_length(cfg, 1.2)
    register.run(cfg)

    refused = invoke("promote", "--version", "2", "--config", str(config))
    assert refused.exit_code == 1 and "offline_accept_length: failed (measured 1.2, threshold 1.5)" in refused.output
    no_reason = invoke("promote", "--version", "2", "--force", "--config", str(config))
    assert no_reason.exit_code == 2 and "--force needs --reason" in no_reason.output
    assert aliases(mlflow_uri) == {"champion": 1, "candidate": 2}
    forced = invoke("promote", "--version", "2", "--force", "--reason", "hotfix for a tokenizer bug", "--config", str(config))
    assert forced.exit_code == 0, forced.output
    assert aliases(mlflow_uri) == {"champion": 2, "previous": 1}
    tags = mlflow.MlflowClient(mlflow_uri).get_model_version(MODEL, "2").tags
    assert tags["eaglet.promotion"] == "forced" and tags["eaglet.promotion_reason"] == "hotfix for a tokenizer bug"
    from tasks.registry.promotion_lock import promotion_lock

    outcome: dict[str, Any] = {}
    with promotion_lock(mlflow_uri, MODEL):  # a registering run between its comparison and its alias move
        waiting = threading.Thread(target=lambda: outcome.update(back=invoke("promote", "--version", "1", "--config",
                                                                             str(config))))
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and aliases(mlflow_uri) == {"champion": 2, "previous": 1}, "the hand promotion waits"
    waiting.join(timeout=60)
    back = outcome["back"]
    assert back.exit_code == 0 and aliases(mlflow_uri) == {"champion": 1, "previous": 2}
    assert invoke("promote", "--version", "7", "--config", str(config)).exit_code == 2

    shown = invoke("registry", "show", "--config", str(config))
    assert shown.exit_code == 0, shown.output
    rows = {line.split("│")[1].strip(): line for line in shown.output.splitlines() if line.count("│") >= 8}
    assert set(rows) >= {"1", "2"}
    revision = json.loads((cfg.output_path / "target.json").read_text())["revision"][:12]
    assert "champion" in rows["1"] and "yes" in rows["1"] and "2.0" in rows["1"] and revision in rows["1"]
    assert "previous" in rows["2"] and " no " in rows["2"] and "1.2" in rows["2"] and "not run" in rows["2"]


@pytest.mark.integration  # the stage asks git for the commit
def test_download_by_alias_gives_back_the_export_byte_for_byte(exported_run: RunConfig, tmp_path: Path,
                                                               mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from models.draft_checkpoint import load_pretrained

    monkeypatch.chdir(tmp_path)
    cfg = run_copy(exported_run, tmp_path / "out", mlflow_uri)
    register.run(cfg)
    target_info = json.loads((cfg.output_path / "target.json").read_text())
    for engine in ("sglang", "vllm"):
        directory = registry_store.download_drafter(cfg, MODEL, "champion", engine, tmp_path / "served")
        export = cfg.output_path / "draft" / engine
        assert directory == tmp_path / "served" / engine
        assert sorted(path.name for path in directory.iterdir()) == ["config.json", "contract.json", "model.safetensors"]
        for name in ("config.json", "contract.json", "model.safetensors"):
            assert (directory / name).read_bytes() == (export / name).read_bytes(), (engine, name)
        draft, contract = load_pretrained(directory, target_info)
        assert contract.engine == engine and draft.config.draft_vocab_size == 128
    again = registry_store.download_drafter(mlflow_uri, MODEL, "champion", "sglang", tmp_path / "served")
    assert (again / "model.safetensors").read_bytes() == (cfg.output_path / "draft" / "sglang" / "model.safetensors").read_bytes()
    with pytest.raises(LookupError, match="alias 'previous'"):
        registry_store.download_drafter(cfg, MODEL, "previous", "sglang", tmp_path / "nothing")


def test_doctor_passes_the_right_target_and_refuses_another(exported_run: RunConfig, tmp_path: Path,
                                                           mlflow_uri: str) -> None:
    from tiny_target import build_tiny_target

    out = exported_run.output_path
    passed = invoke("doctor", str(out / "draft"), "--target", str(out / "target"))
    assert passed.exit_code == 0, passed.output
    assert "FAILED" not in passed.output and "all checks passed" in passed.output
    assert "draft/sglang" in passed.output and "draft/vllm" in passed.output
    source = invoke("doctor", str(out / "draft" / "vllm"), "--target", exported_run.model.path or "")
    assert source.exit_code == 0, "the HF directory the run was made from describes the same target"

    other = build_tiny_target(tmp_path / "other-target", num_layers=4, hidden_size=32, seed=1)
    refused = invoke("doctor", str(out / "draft" / "sglang"), "--target", str(other))
    assert refused.exit_code == 1
    assert "FAILED target.hidden_size: checkpoint has 64, target has 32" in refused.output
    assert "FAILED target.target_revision" in refused.output

    cfg = run_copy(exported_run, tmp_path / "out", mlflow_uri)
    vllm = cfg.output_path / "draft" / "vllm" / "config.json"
    config = json.loads(vllm.read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]  # the SGLang convention in a vLLM export
    vllm.write_text(json.dumps(config))
    wrong_ids = invoke("doctor", str(vllm.parent), "--target", str(cfg.output_path))
    assert wrong_ids.exit_code == 1
    assert "FAILED eagle_config.eagle_aux_hidden_state_layer_ids: [1, 2, 3] for vllm; expected [2, 3, 4]" in wrong_ids.output
    with pytest.raises(ContractMismatch, match="eagle_aux_hidden_state_layer_ids"):
        register.run(cfg)


def test_a_run_ends_saying_where_things_are_and_who_is_champion(tmp_path: Path, capsys) -> None:
    from flows.cli import print_where_things_are

    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "tracking": {"enabled": True}})
    (tmp_path / "reports" / "data_docs").mkdir(parents=True)
    (tmp_path / "reports" / "data_docs" / "index.html").write_text("<html></html>")
    (tmp_path / "register").mkdir()
    held_back = {"model_name": "m", "version": 2, "aliases": ["candidate"], "champion_before": 1,
                 "failed_gates": ["speedup[vllm]: failed (measured 0.81, threshold 1)"]}
    (tmp_path / "register" / "registration.json").write_text(json.dumps(held_back))
    print_where_things_are(cfg)
    printed = capsys.readouterr().out
    assert f"Data Docs:     {(tmp_path / 'reports' / 'data_docs' / 'index.html').as_uri()}" in printed
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}" in printed
    assert ("champion:      models:/m@champion = version 1; this run's version 2 stays candidate "
            "(speedup[vllm]: failed (measured 0.81, threshold 1))") in printed
    promoted = {**held_back, "aliases": ["champion"], "failed_gates": []}
    (tmp_path / "register" / "registration.json").write_text(json.dumps(promoted))
    print_where_things_are(cfg)
    assert "champion:      models:/m@champion = version 2 (this run)" in capsys.readouterr().out


def recommending(speedups: list[dict[str, Any]], **engine: Any) -> BenchmarkReport:
    """A vLLM benchmark recommending a chain of 2 whose speedup rows are `speedups`."""
    check = {"status": "ok", "check": "per_position", "min_p_value": 0.4}
    return BenchmarkReport.model_validate(benchmark_report({"vllm": engine_report(speedups, check, steps=2, **engine)}))


@pytest.mark.parametrize("method", typing.get_args(DraftConfig.model_fields["method"].annotation))
def test_every_methods_drafter_gets_a_logged_model_name_mlflow_accepts(method: str, mlflow_uri: str) -> None:
    """`make run` registers the embedded default's EAGLE 3.1 drafter: MLflow refuses '.' in a logged model's name."""
    mlflow.set_tracking_uri(mlflow_uri)
    experiment = mlflow.set_experiment("names")
    with mlflow.start_run() as active:
        model = mlflow.initialize_logged_model(name=register.logged_model_name(method),
                                               source_run_id=active.info.run_id,
                                               experiment_id=experiment.experiment_id)
        mlflow.finalize_logged_model(model.model_id, "READY")
    assert model.name.endswith("-drafter") and model.name.startswith(method.split(".")[0])


def test_the_recommended_serving_setting_travels_in_the_contract_and_a_tag() -> None:
    flags = {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 2}}
    sweep = [{"label": f"k{k}", "setting": {"steps": k, "topk": 1, "num_draft_tokens": k + 1}, "num_speculative_tokens": k,
              "mean_accept_length": length, "speedup": speedup_rows((1, speedup)), "predicted_speedup": predicted}
             for k, length, speedup, predicted in ((1, 1.4, 1.1, 1.2), (2, 1.6, 1.3, 1.25))]
    report = recommending(speedup_rows((1, 1.3)), sweep=sweep, serving_setting={
        "steps": 2, "topk": 1, "num_draft_tokens": 3, "label": "k2", "flags": flags})
    assert json.loads(register.recommended_serving(report, None, "eagle3.1")) == {"vllm": {
        "method": "eagle3.1", "num_speculative_tokens": 2, "steps": 2, "topk": 1, "num_draft_tokens": 3, "flags": flags,
        "speedup": 1.3}}
    summary = register.serving_summary(report)["engines"]["vllm"]
    assert summary["recommended_num_speculative_tokens"] == 2 and [row["num_speculative_tokens"]
                                                                   for row in summary["sweep"]] == [1, 2]
    assert summary["recommended_setting"]["flags"] == flags
    assert register.recommended_serving(None, None, "eagle3") == "not measured"


def test_the_recommended_speedup_is_read_at_the_level_the_speedup_gate_reads() -> None:
    report = recommending(speedup_rows((1, 1.3), (4, 0.8)))
    assert json.loads(register.recommended_serving(report, 4, "eagle3"))["vllm"]["speedup"] == 0.8, \
        "registry.speedup_concurrency"
    assert json.loads(register.recommended_serving(report, None, "eagle3"))["vllm"]["speedup"] == 1.3, \
        "the lowest by default"


def test_the_serving_summary_keeps_sglangs_measured_accept_length() -> None:
    """SGLang's acceptance is in its gauges (eagle3.speculative), not in a per-position agreement check."""
    check = {"status": "inconclusive", "reason": "SGLang exposes no per-position acceptance counters"}
    engine = engine_report(speedup_rows((1, 1.6)), check, mean_accept_length=3.4)
    report = BenchmarkReport.model_validate(benchmark_report({"sglang": engine}))
    assert register.serving_summary(report)["engines"]["sglang"]["mean_accept_length"] == 3.4
