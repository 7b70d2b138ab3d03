"""Acceptance per suite and category with bootstrap intervals: the one summary the evaluate stage (offline decoder)
and the benchmark stage (suites replayed on the engine) both write, plot and log, so the two read alike.

A unit is what the interval resamples: a prompt, or (an engine replaying several prompts at once, whose counters
cannot tell them apart) a group of prompts of one category. The buckets are named `source=<suite>`,
`category=<category>`, `prompt_tokens<bound>` and `turn=<n>`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from contract.hashing import hash_text
from tasks.common.artifacts import save_figure
from tasks.common.intervals import PromptRounds, tau_interval


def bucket_report(units: list[PromptRounds]) -> dict[str, Any]:
    """A bucket's pooled τ over its units' rounds, with its bootstrap interval over those units."""
    interval = tau_interval(units)
    return {"rounds": int(sum(unit.rounds for unit in units)), "mean_accept_length": interval.estimate,
            "prompts": interval.prompts, "low": interval.low, "high": interval.high}


def bucket_names(source: str, category: str, length_bucket: str, turn: int) -> list[str]:
    """The buckets a prompt (or a group of prompts sharing these) counts in."""
    return [f"source={source}", f"category={category}", f"prompt_tokens{length_bucket}", f"turn={turn}"]


def prompt_hash(input_ids: list[int]) -> str:
    """What a prompt's rounds are paired on across versions: the token ids it decoded from, not its name."""
    return hash_text(json.dumps(input_ids))


def suite_buckets(mode: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The mode's source (suite) buckets, then its category buckets: the ones a user picks a drafter by."""
    chosen = {}
    for kind in ("source=", "category="):
        chosen.update({name: values for name, values in mode["buckets"].items()
                       if name.startswith(kind) and name != "category=-"})
    return chosen


def metric_name(bucket: str) -> str:
    """`category=writing` as an MLflow metric name part (letters, digits, _ - . / only): `category.writing`."""
    return re.sub(r"[^A-Za-z0-9_./-]", "_", bucket.replace("=", "."))


def interval_metrics(prefix: str, summary: dict[str, Any]) -> dict[str, float]:
    """τ with its interval bounds, and τ per suite and category, as MLflow metrics under `prefix`."""
    numbers = {f"{prefix}_mean_accept_length": summary["mean_accept_length"],
               f"{prefix}_mean_accept_length_low": summary["mean_accept_length_interval"]["low"],
               f"{prefix}_mean_accept_length_high": summary["mean_accept_length_interval"]["high"]}
    for bucket, values in suite_buckets(summary).items():
        numbers[f"{prefix}_mean_accept_length.{metric_name(bucket)}"] = values["mean_accept_length"]
    return numbers


def plot_suites(summary: dict[str, Any], path: Path, measured_by: str = "offline decoder",
                unit: str = "prompts") -> Path:
    """τ over all units, per source and per category, each with its 95 % bootstrap interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    overall = summary["mean_accept_length_interval"]
    rows = [("all", summary["mean_accept_length"], overall["low"], overall["high"], overall["prompts"])]
    rows += [(name, values["mean_accept_length"], values["low"], values["high"], values["prompts"])
             for name, values in suite_buckets(summary).items()]
    figure, axis = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.2))
    positions = list(range(len(rows)))[::-1]
    estimates = [row[1] for row in rows]
    axis.errorbar(estimates, positions, xerr=[[row[1] - row[2] for row in rows], [row[3] - row[1] for row in rows]],
                  fmt="o", capsize=3)
    axis.set_yticks(positions)
    axis.set_yticklabels([f"{row[0]} ({row[4]})" for row in rows])
    axis.set_xlabel(f"tau, chain of {summary['steps']} (95 % bootstrap interval over {unit})")
    axis.set_title(f"Acceptance length per suite and category ({measured_by}, {unit})")
    return save_figure(figure, path)
