"""Whole stage reports as the stages write them (contract/reports.py), with only what a test plants changed.

The reports are typed, so a test cannot plant half a report: these fill in the rest with plausible numbers.
"""

from __future__ import annotations

from typing import Any, Optional

from contract.reports import AcceptanceReport, BenchmarkReport


def mode_acceptance(steps: int = 3, rounds: int = 10, accepted: Optional[list[float]] = None,
                    per_prompt: Optional[list[dict[str, Any]]] = None, **changes: Any) -> dict[str, Any]:
    """One mode of evaluate/acceptance.json: `rounds` rounds accepting `accepted` at each position."""
    accepted = list(accepted if accepted is not None else [rounds / 2] * steps)
    generated = 1 + rounds + int(sum(accepted))
    tau = 1 + sum(accepted) / rounds if rounds else 0.0
    mode = {
        "steps": steps, "topk": 1, "num_draft_tokens": steps + 1, "rounds": rounds,
        "mean_accept_length": tau, "mean_accept_length_interval": {"low": tau, "high": tau, "prompts": 1},
        "acceptance_by_depth": [count / rounds if rounds else 0.0 for count in accepted],
        "accept_length_histogram": {str(length): 0 for length in range(1, steps + 2)},
        "accepted_per_position": accepted,
        "per_prompt": per_prompt if per_prompt is not None else [
            {"prompt": "s:1#turn1", "rounds": rounds, "accepted_per_position": accepted, "generated_tokens": generated}],
        "mean_drafted_tokens": float(steps), "target_forwards": rounds + 1, "generated_tokens": generated,
        "tokens_per_target_forward": generated / (rounds + 1), "draft_time_share": 0.3, "draft_seconds": 0.6,
        "verify_seconds": 1.0, "tokens_per_second": 20.0, "buckets": {}, "speedup_vs_target": 2.0,
    }
    return {**mode, **changes}


def acceptance_report(chain: Optional[dict[str, Any]] = None, tree: Optional[dict[str, Any]] = None,
                      **changes: Any) -> dict[str, Any]:
    """evaluate/acceptance.json, validated: greedy equivalence passed unless `changes` says otherwise."""
    report = {"prompts": 1, "records": 1, "temperature": 0.0, "max_new_tokens": 32, "drafter": "draft/sglang",
              "target": {"generated_tokens": 32, "tokens_per_second": 10.0},
              "chain": chain if chain is not None else mode_acceptance(),
              "greedy_equivalence": "passed", "greedy_mismatches": [], **changes}
    if tree is not None:
        report["tree"] = tree
    return AcceptanceReport.model_validate(report).as_json()


def speedup_rows(*speedups: tuple[int, float]) -> list[dict[str, Any]]:
    """(concurrency, median speedup) pairs as the benchmark's one-round speedup rows."""
    return [{"concurrency": level, "output_tokens_per_s": value, "min": value, "max": value, "per_round": [value]}
            for level, value in speedups]


def engine_report(speedup: list[dict[str, Any]], acceptance_check: dict[str, Any], mean_accept_length: float = 2.1,
                  steps: int = 3, failures: tuple[str, ...] = (), **changes: Any) -> dict[str, Any]:
    """One engine of benchmark/report.json, recommending the chain of `steps`."""
    setting = {"steps": steps, "topk": 1, "num_draft_tokens": steps + 1}
    speculative = {"window": {}, "mean_accept_length": mean_accept_length, "draft_acceptance_rate": 0.5,
                   "acceptance_rate_per_position": []}
    variant = {"command": ["serve"], "log": "engine.log", "startup_s": 1.0, "peak_rss_mib": 100.0, "levels": [],
               "rounds": []}
    engine = {
        "baseline": variant, "num_speculative_tokens": steps,
        "serving_setting": {**setting, "label": f"k{steps}", "flags": {}},
        "eagle3": {**variant, "num_speculative_tokens": steps, "serving_setting": setting, "speculative": speculative},
        "speedup": speedup,
        "sweep": [{"label": f"k{steps}", "setting": setting, "num_speculative_tokens": steps,
                   "mean_accept_length": mean_accept_length, "speedup": speedup, "predicted_speedup": None}],
        "greedy": {"status": "ok", "compared": 8, "mismatches": []}, "acceptance_check": acceptance_check,
        "failures": list(failures),
    }
    return {**engine, **changes}


def benchmark_report(engines: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """benchmark/report.json over these engines, validated; failed when any engine failed."""
    failures = [failure for engine in engines.values() for failure in engine["failures"]]
    report = {"settings": {"concurrency": sorted({row["concurrency"] for engine in engines.values()
                                                  for row in engine["speedup"]})},
              "engines": engines, "failures": failures, "passed": not failures}
    return BenchmarkReport.model_validate(report).as_json()


SKIPPED_BENCHMARK = BenchmarkReport.model_validate(
    {"skipped": "benchmark.engines is empty", "engines": {}, "failures": [], "passed": True}).as_json()
