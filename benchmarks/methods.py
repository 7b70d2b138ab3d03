"""Which draft method serves best for this target, data and budget: EAGLE3, EAGLE 3.1, P-EAGLE and DFlash side by side.

    .venv/bin/python benchmarks/methods.py --config params.yaml [--methods eagle3 eagle3.1 peagle dflash] \
        [--speculative-tokens 2 3] [--folder methods] [overrides for every method]

Reads a finished run (`eaglet run` up to capture at least). Each method is a sub-run under
`<output_dir>/<folder>/<method>/` (hard links to the run's target, records and feature shards: benchmarks/subruns.py;
`--folder` defaults to `methods`, and another folder repeats the comparison, e.g. with `runtime.seed=1` to see how
far a training seed moves τ) trained with the run's recipe and budget (the same records, epochs and tokens per step:
the same training tokens), evaluated offline (the chain on the reference prompts) and then served by the benchmark
stage's own `run` on vLLM's CPU build: the target alone and the drafter at each number of speculative tokens,
`benchmark.rounds` alternating rounds on engines started once, and the suites of `evaluation.sets` replayed on the
engine drafting the longest chain (held-out τ over the suite prompts with a 95 % bootstrap interval, acceptance by
position).

Prints one row per method: suite τ [interval], acceptance by position, and the speedup over the target alone at each
k (median [min-max] of the rounds); then each method's τ against the first method's on the same suite prompts (the
paired bootstrap the registry's gates use: prompts shared by name and token hash, resampled together, so the prompts'
shared difficulty cancels and a difference of a few hundredths can be told from noise); the best k of each method
and the best method by median speedup. Writes `<output_dir>/<folder>/methods.json` and `methods.png` (τ with
intervals; speedup per k), logged to an MLflow run named `methods`. A finished method is reused (delete its folder
to redo it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from contract.config_loading import load_config
from contract.reports import BenchmarkReport, PromptAcceptance, load_report
from models.draft_methods import METHODS
from subruns import POINT_FILE, link_run_features, link_run_inputs, measure_point, subrun_config
from tasks import benchmark
from tasks.common.artifacts import read_json, save_figure, write_json
from tasks.register import SERVING_REPORT
from tasks.registry.comparison import SetComparison, compare_rows

SERVED_FILE = "served.json"


def served_point(cfg: Any) -> dict[str, Any]:
    """The benchmark stage on a trained sub-run, reduced to what the comparison reads (reused when finished)."""
    out = cfg.output_path
    if (out / SERVED_FILE).is_file():
        return read_json(out / SERVED_FILE)
    report = benchmark.run(cfg).report
    engine = report["engines"]["vllm"]
    suites = engine["suites"]
    served = {
        "speedup_by_k": {str(row["num_speculative_tokens"]): row["speedup"][0] for row in engine["sweep"]},
        "engine_accept_length_by_k": {str(row["num_speculative_tokens"]): row["mean_accept_length"]
                                      for row in engine["sweep"]},
        "suite_tau": suites["mean_accept_length"],
        "suite_tau_interval": [suites["mean_accept_length_interval"]["low"],
                               suites["mean_accept_length_interval"]["high"]],
        "suite_prompts": suites["prompts"],
        "suite_acceptance_by_position": suites["acceptance_by_position"],
        "agreement": engine["acceptance_check"]["status"],
    }
    write_json(out / SERVED_FILE, served)
    return served


def suite_rows(cfg: Any) -> list[PromptAcceptance]:
    """The sub-run's suite prompts as its vLLM engine replayed them (per-prompt rounds and acceptance, token hash)."""
    report = load_report(BenchmarkReport, cfg.output_path / SERVING_REPORT, "benchmark")
    suites = report.engines["vllm"].suites
    if suites is None:
        raise SystemExit(f"{cfg.output_path / SERVING_REPORT}: no suites replayed on the engine (evaluation.sets)")
    return suites.per_prompt


def paired_taus(rows: dict[str, list[PromptAcceptance]], baseline: str) -> dict[str, dict[str, Any]]:
    """Each other method's suite τ minus `baseline`'s over the same prompts, with the paired 95 % interval; a method
    replayed on other prompts says so instead."""
    paired: dict[str, dict[str, Any]] = {}
    for method, method_rows in rows.items():
        if method == baseline:
            continue
        comparison = compare_rows("suites", method_rows, rows[baseline])
        if isinstance(comparison, SetComparison):
            paired[method] = {"against": baseline, "difference": comparison.difference.as_json(),
                              "describe": comparison.describe().replace("champion", baseline)}
        else:
            paired[method] = {"against": baseline, "incomparable": comparison.reason}
    return paired


def best_k(served: dict[str, Any]) -> str:
    return max(served["speedup_by_k"], key=lambda k: served["speedup_by_k"][k]["output_tokens_per_s"])


def describe(method: str, point: dict[str, Any]) -> str:
    served = point["served"]
    low, high = served["suite_tau_interval"]
    speedups = "  ".join(f"k{k} {row['output_tokens_per_s']:.3f}x [{row['min']:.3f}-{row['max']:.3f}]"
                         for k, row in served["speedup_by_k"].items())
    return (f"{method:<9} suite tau {served['suite_tau']:.3f} [{low:.3f}-{high:.3f}] over {served['suite_prompts']} "
            f"prompts, by position {[round(rate, 3) for rate in served['suite_acceptance_by_position']]}; "
            f"offline chain tau {point['chain_mean_accept_length']:.3f}; agreement {served['agreement']}; "
            f"train {point['train_seconds']:.0f}s; speedup {speedups}")


def plot_methods(points: dict[str, dict[str, Any]], path: Path) -> Path:
    """Suite τ with its interval per method, and the median speedup (with its range) per k per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(points)
    figure, (tau, speed) = plt.subplots(1, 2, figsize=(11, 4))
    values = [points[name]["served"]["suite_tau"] for name in names]
    lows = [value - points[name]["served"]["suite_tau_interval"][0] for name, value in zip(names, values)]
    highs = [points[name]["served"]["suite_tau_interval"][1] - value for name, value in zip(names, values)]
    tau.bar(names, values, yerr=[lows, highs], capsize=4)
    tau.set(ylabel="held-out tau on the engine (95 % interval)", title="acceptance", ylim=(1.0, max(values) * 1.05))
    for name in names:
        rows = points[name]["served"]["speedup_by_k"]
        ks = sorted(rows, key=int)
        medians = [rows[k]["output_tokens_per_s"] for k in ks]
        speed.errorbar([int(k) for k in ks], medians, capsize=4, marker="o", label=name,
                       yerr=[[median - rows[k]["min"] for k, median in zip(ks, medians)],
                             [rows[k]["max"] - median for k, median in zip(ks, medians)]])
    speed.axhline(1.0, color="grey", linewidth=1)
    speed.set(xlabel="speculative tokens", ylabel="output tok/s vs the target alone", title="vLLM CPU speedup")
    speed.legend()
    for axis in (tau, speed):
        axis.grid(alpha=0.3)
    return save_figure(figure, path)


def log_methods(run_cfg: Any, points: dict[str, dict[str, Any]], paired: dict[str, dict[str, Any]],
                files: list[Path]) -> None:
    """One MLflow run `methods`: per method its τ, interval, paired difference to the first method and speedup per k
    as metrics; the files as artifacts."""
    import mlflow

    from tasks.common.mlflow_store import ensure_experiment, tracking_uri

    mlflow.set_tracking_uri(tracking_uri(run_cfg))
    ensure_experiment(tracking_uri(run_cfg), run_cfg.tracking.experiment)
    with mlflow.start_run(run_name="methods", tags={"eaglet.kind": "methods"}):
        for method, point in points.items():
            served = point["served"]
            low, high = served["suite_tau_interval"]
            metrics = {f"{method}_suite_tau": served["suite_tau"], f"{method}_suite_tau_low": low,
                       f"{method}_suite_tau_high": high}
            for k, row in served["speedup_by_k"].items():
                metrics[f"{method}_speedup_k{k}"] = row["output_tokens_per_s"]
            difference = paired.get(method, {}).get("difference")
            if difference is not None:
                metrics.update({f"{method}_suite_tau_paired_difference": difference["estimate"],
                                f"{method}_suite_tau_paired_difference_low": difference["low"],
                                f"{method}_suite_tau_paired_difference_high": difference["high"]})
            mlflow.log_metrics(metrics)
        for path in files:
            mlflow.log_artifact(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--speculative-tokens", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--folder", default="methods", help="sub-runs under <output_dir>/<folder>/<method>/")
    parser.add_argument("overrides", nargs="*", help="section.field=value for every method")
    args = parser.parse_args()
    run_cfg = load_config(args.config, args.overrides)
    run_dir = run_cfg.output_path
    if not (run_dir / "features" / "manifest.json").is_file():
        raise SystemExit(f"{run_dir}: no features/manifest.json; run the pipeline up to capture first")
    tokens = sorted(set(args.speculative_tokens))
    served_setting = [f"benchmark.num_speculative_tokens={json.dumps(tokens)}", f"evaluation.steps={tokens[-1]}",
                      "benchmark.engines=[vllm]"]
    points: dict[str, dict[str, Any]] = {}
    rows: dict[str, list[PromptAcceptance]] = {}
    for method in args.methods:
        directory = (run_dir / args.folder / method).resolve()
        cfg = subrun_config(args.config, [*args.overrides, *served_setting, f"draft.method={method}"], directory,
                            f"method-{method}")
        if not (directory / POINT_FILE).is_file():
            link_run_inputs(run_dir, directory)
            link_run_features(run_dir, directory)
        point = measure_point(cfg, {"method": method})
        point["served"] = served_point(cfg)
        points[method] = point
        rows[method] = suite_rows(cfg)
        print(describe(method, point), flush=True)
    paired = paired_taus(rows, args.methods[0])
    for method, comparison in paired.items():
        print(f"{method:<9} {comparison.get('describe') or comparison['incomparable']}")
    best = {method: best_k(point["served"]) for method, point in points.items()}
    winner = max(points, key=lambda method: points[method]["served"]["speedup_by_k"][best[method]][
        "output_tokens_per_s"])
    json_path = run_dir / args.folder / "methods.json"
    write_json(json_path, {"config": str(args.config), "overrides": args.overrides, "speculative_tokens": tokens,
                           "best_k": best, "best_method": winner, "paired_suite_tau": paired, "points": points})
    png_path = plot_methods(points, run_dir / args.folder / "methods.png")
    if run_cfg.tracking.enabled:
        log_methods(run_cfg, points, paired, [json_path, png_path])
    print(json.dumps({"best_method": winner, "best_k": best, "methods": str(json_path), "plot": str(png_path)}))


if __name__ == "__main__":
    main()
