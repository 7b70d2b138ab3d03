"""Sub-runs of a finished run, shared by the training benchmarks (learning_curve.py, recipe_sweep.py).

A sub-run is a folder under the run's output directory that holds hard links to the run's target and
held-out records (and, when its capture settings match, the run's feature shards), a train split of its own,
and a config pointing at it with tracking off: the benchmark logs its points once, in one MLflow run.
Each point runs the stages' own `run(cfg)` (capture -> train -> evaluate, chain only as vLLM drafts), so a
point measures exactly what `eaglet run` would produce with that data and recipe.
"""

from __future__ import annotations

import time
from dataclasses import astuple
from pathlib import Path
from typing import Any, Iterable, Optional

from contract.config import RunConfig
from contract.config_loading import load_config
from tasks import capture, evaluate, train
from tasks.common.artifacts import link_or_copy, read_json, write_json, write_jsonl
from tasks.common.intervals import Interval, PromptRounds, paired_difference, prompt_rounds
from tasks.serving.speedup_model import predicted_speedup

POINT_FILE = "point.json"


def subrun_config(config: Path, overrides: list[str], directory: Path, run_id: str) -> RunConfig:
    """The run's config with `overrides`, pointed at the sub-run's folder; chain-only evaluation, tracking off."""
    return load_config(config, [*overrides, f"output_dir={directory}", f"run_id={run_id}",
                                "evaluation.topk=1", "tracking.enabled=false"])


def link_run_inputs(run_dir: Path, directory: Path, train_records: Optional[list[Any]] = None) -> None:
    """Target and held-out records as hard links; the run's train records, or `train_records` when given."""
    for path in (run_dir / "target").iterdir():
        link_or_copy(path, directory / "target" / path.name)
    link_or_copy(run_dir / "target.json", directory / "target.json")
    link_or_copy(run_dir / "data" / "eval.jsonl", directory / "data" / "eval.jsonl")
    if train_records is None:
        link_or_copy(run_dir / "data" / "train.jsonl", directory / "data" / "train.jsonl")
    else:
        write_jsonl(directory / "data" / "train.jsonl", train_records)


def link_run_features(run_dir: Path, directory: Path) -> None:
    """The run's feature shards and vocabulary mapping: capture keeps every shard whose records and capture
    settings are unchanged and rewrites the rest, so a recipe that changes capture settings still captures."""
    for folder in ("features/train", "features/eval", "vocab"):
        source = run_dir / folder
        if source.is_dir():
            for path in source.iterdir():
                link_or_copy(path, directory / folder / path.name)


def measure_point(cfg: RunConfig, extra: dict[str, Any]) -> dict[str, Any]:
    """capture -> train -> evaluate on one sub-run, reduced to the numbers the benchmarks report;
    a finished point (its point.json) is reused."""
    out = cfg.output_path
    if (out / POINT_FILE).is_file():
        return read_json(out / POINT_FILE)
    manifest = capture.run(cfg).manifest
    started = time.perf_counter()
    summary = train.run(cfg).summary()
    train_seconds = time.perf_counter() - started
    report = evaluate.run(cfg).report
    chain = report["chain"]
    steps = cfg.training.ttt_length
    point = {
        **extra,
        "supervised_tokens": manifest["splits"]["train"]["supervised_tokens"],
        "train_tokens": manifest["splits"]["train"]["tokens"],
        "optimizer_steps": summary["steps"],
        "train_seconds": train_seconds,
        "chain_mean_accept_length": chain["mean_accept_length"],
        "chain_mean_accept_length_interval": [chain["mean_accept_length_interval"]["low"],
                                              chain["mean_accept_length_interval"]["high"]],
        "chain_prompt_rounds": {item["prompt"]: list(astuple(prompt_rounds(item["rounds"],
                                                                          item["accepted_per_position"])))
                                for item in chain["per_prompt"]},
        "chain_acceptance_by_depth": chain["acceptance_by_depth"],
        "predicted_speedup_by_k": {str(k): predicted_speedup(report, k)
                                   for k in range(1, len(chain["acceptance_by_depth"]) + 1)},
        "eval_acc_by_depth": [summary[f"eval_acc_{k}"] for k in range(steps)],
        "eval_simulated_accept_len": summary["eval_simulated_accept_len"],
    }
    write_json(out / POINT_FILE, point)
    return point


def describe_tau(point: dict[str, Any]) -> str:
    """`1.242 [1.208-1.278]`: the point's held-out τ and its 95 % bootstrap interval over prompts."""
    low, high = point["chain_mean_accept_length_interval"]
    return f"{point['chain_mean_accept_length']:.3f} [{low:.3f}-{high:.3f}]"


def paired_against(point: dict[str, Any], baseline: dict[str, Any]) -> Interval:
    """τ(point) − τ(baseline) on the prompts both evaluated, with its paired bootstrap interval."""
    shared = [key for key in baseline["chain_prompt_rounds"] if key in point["chain_prompt_rounds"]]
    return paired_difference([PromptRounds(*point["chain_prompt_rounds"][key]) for key in shared],
                             [PromptRounds(*baseline["chain_prompt_rounds"][key]) for key in shared])


def point_metrics(point: dict[str, Any]) -> dict[str, float]:
    """One point as MLflow metrics."""
    metrics = {"supervised_tokens": float(point["supervised_tokens"]),
               "train_seconds": float(point["train_seconds"]),
               "chain_mean_accept_length": float(point["chain_mean_accept_length"]),
               "chain_mean_accept_length_low": float(point["chain_mean_accept_length_interval"][0]),
               "chain_mean_accept_length_high": float(point["chain_mean_accept_length_interval"][1]),
               "eval_simulated_accept_len": float(point["eval_simulated_accept_len"])}
    for depth, rate in enumerate(point["chain_acceptance_by_depth"]):
        metrics[f"chain_acceptance_depth{depth + 1}"] = float(rate)
    for k, speedup in point["predicted_speedup_by_k"].items():
        if speedup is not None:
            metrics[f"predicted_speedup_k{k}"] = float(speedup)
    return metrics


def log_points(run_cfg: RunConfig, run_name: str, points: list[dict[str, Any]], files: Iterable[Path]) -> None:
    """The points (one metric step each) and the benchmark's files in one MLflow run of the run's experiment."""
    import mlflow

    from tasks.common.mlflow_store import ensure_experiment, tracking_uri

    mlflow.set_tracking_uri(tracking_uri(run_cfg))
    ensure_experiment(tracking_uri(run_cfg), run_cfg.tracking.experiment)
    with mlflow.start_run(run_name=run_name, tags={"eaglet.kind": run_name}):
        for step, point in enumerate(points):
            mlflow.log_metrics(point_metrics(point), step=step)
        for path in files:
            mlflow.log_artifact(str(path))
