"""Held-out acceptance against training data: how much data does this drafter need?

    .venv/bin/python benchmarks/learning_curve.py --config params.yaml [--fractions 0.125 0.25 0.5 1] \
        [--method eagle3|eagle3.1|peagle|dflash] [overrides]

Reads a finished run (`eaglet run` up to validate at least): its target and its validated records
`data/{train,eval}.jsonl`. For each fraction f, a sub-run under `<output_dir>/learning-curve/f<f>/` gets the
first ceil(f * N) train records of one seeded shuffle (nested: every larger fraction holds the smaller ones),
the same held-out records and the same recipe (the run config plus `overrides`), and runs the stages
capture -> train -> evaluate (chain only, as vLLM drafts) through their own `run(cfg)`. Each point records the
supervised training tokens, the held-out chain accept length tau and acceptance by depth (evaluate stage,
the reference decoder on the evaluate stage's prompts) and the trainer's held-out acc_k.

`--method` trains every point as that draft method (`draft.method`) in `<output_dir>/learning-curve/<method>/`, so
the curves of several methods sit side by side. Writes `<output_dir>/learning-curve/learning_curve.json` and `learning_curve.png`, and logs both, with one
metric step per point, to an MLflow run named `learning-curve` in the run's experiment. Sub-runs already
finished are reused (delete their folder to redo one).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any

from contract.config_loading import load_config
from contract.records import read_prompt_records
from models.draft_methods import METHODS
from subruns import POINT_FILE, describe_tau, link_run_inputs, log_points, measure_point, subrun_config
from tasks.common.artifacts import save_figure, write_json


def plot_curve(points: list[dict[str, Any]], path: Path) -> Path:
    """Accept length and acceptance by depth against supervised training tokens (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [point["supervised_tokens"] for point in points]
    figure, (tau, depth) = plt.subplots(1, 2, figsize=(10, 4))
    taus = [point["chain_mean_accept_length"] for point in points]
    tau.errorbar(tokens, taus, yerr=[[value - point["chain_mean_accept_length_interval"][0] for value, point in
                                      zip(taus, points)],
                                     [point["chain_mean_accept_length_interval"][1] - value for value, point in
                                      zip(taus, points)]], fmt="-o", capsize=4)
    tau.set(xscale="log", xlabel="supervised training tokens", ylabel="chain mean accept length (tau)",
            title="held-out accept length")
    for index in range(len(points[0]["chain_acceptance_by_depth"])):
        depth.plot(tokens, [point["chain_acceptance_by_depth"][index] for point in points], "-o",
                   label=f"depth {index + 1}")
    depth.set(xscale="log", xlabel="supervised training tokens", ylabel="acceptance rate",
              title="held-out acceptance by depth")
    depth.legend()
    for axis in (tau, depth):
        axis.grid(alpha=0.3)
    return save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", choices=METHODS, help="train every point as this draft method")
    parser.add_argument("overrides", nargs="*", help="section.field=value for every point (the recipe)")
    args = parser.parse_args()
    if args.method is not None:
        args.overrides = [*args.overrides, f"draft.method={args.method}"]
    run_cfg = load_config(args.config, args.overrides)
    run_dir = run_cfg.output_path
    records = [record for _, record in read_prompt_records(run_dir / "data" / "train.jsonl")]
    random.Random(args.seed).shuffle(records)
    curve_dir = run_dir / "learning-curve" / (args.method or "")
    points = []
    for fraction in sorted(args.fractions):
        count = max(1, math.ceil(fraction * len(records)))
        directory = (curve_dir / f"f{fraction:g}").resolve()
        label = f"learning-curve-{args.method}-f{fraction:g}" if args.method else f"learning-curve-f{fraction:g}"
        cfg = subrun_config(args.config, args.overrides, directory, label)
        if not (directory / POINT_FILE).is_file():
            link_run_inputs(run_dir, directory, records[:count])
        point = measure_point(cfg, {"fraction": fraction, "train_records": count})
        points.append(point)
        print(f"f={fraction:<6g} records {count:>5}  supervised tokens {point['supervised_tokens']:>7}  "
              f"tau {describe_tau(point)}  by depth "
              f"{[round(rate, 3) for rate in point['chain_acceptance_by_depth']]}", flush=True)
    json_path = curve_dir / "learning_curve.json"
    write_json(json_path, {"config": str(args.config), "overrides": args.overrides, "seed": args.seed,
                           "points": points})
    png_path = plot_curve(points, curve_dir / "learning_curve.png")
    if run_cfg.tracking.enabled:
        log_points(run_cfg, f"learning-curve-{args.method}" if args.method else "learning-curve", points,
                   [json_path, png_path])
    print(json.dumps({"learning_curve": str(json_path), "plot": str(png_path)}))


if __name__ == "__main__":
    main()
