"""Which training recipe gives the best held-out drafter for this data and budget?

    .venv/bin/python benchmarks/recipe_sweep.py --config params.yaml \
        --recipe base: --recipe ttt3:training.ttt_length=3 --recipe lr1e-3:training.learning_rate=1e-3 \
        [--recipe NAME:section.field=value,section.field=value ...] [overrides for every recipe]

Reads a finished run (`eaglet run` up to capture at least): its target, validated records and feature shards.
Each recipe is a named set of overrides on the run's config; its sub-run under
`<output_dir>/recipe-sweep/<name>/` reuses the run's shards (hard links; capture rewrites them only when the
recipe changes capture settings, such as `capture.draft_vocab_size`) and runs train -> evaluate (chain, as
vLLM drafts) on the same held-out prompts. Each point records the held-out chain accept length and acceptance
by depth, the trainer's held-out acc_k, the training wall time (same machine, one recipe at a time) and the
offline speedup predicted for 1..steps speculative tokens (tasks/serving/speedup_model.py).

Writes `<output_dir>/recipe-sweep/recipe_sweep.json` and `recipe_sweep.png` (accept length and depth-1
acceptance per recipe), logged to an MLflow run named `recipe-sweep`. Finished recipes are reused (delete a
recipe's folder to redo it); the best recipe by held-out accept length is printed.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from contract.config_loading import load_config
from subruns import (POINT_FILE, describe_tau, link_run_features, link_run_inputs, log_points, measure_point,
                     paired_against, subrun_config)
from tasks.common.artifacts import save_figure, write_json

RECIPE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def parse_recipe(text: str) -> tuple[str, list[str]]:
    """'NAME:a.b=1,c.d=2' -> ('NAME', ['a.b=1', 'c.d=2']); 'NAME:' is the run's own recipe."""
    name, separator, body = text.partition(":")
    if not separator or not RECIPE_NAME.match(name):
        raise SystemExit(f"--recipe {text!r}: expected NAME:section.field=value[,section.field=value...] "
                         "(NAME: letters, digits, '.', '_', '-')")
    overrides = [item.strip() for item in body.split(",") if item.strip()]
    for item in overrides:
        if "=" not in item:
            raise SystemExit(f"--recipe {name}: {item!r} is not section.field=value")
    return name, overrides


def plot_recipes(points: list[dict[str, Any]], path: Path) -> Path:
    """Held-out accept length and depth-1 acceptance, one bar per recipe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [point["recipe"] for point in points]
    figure, (tau, first) = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(names) + 4), 4))
    taus = [point["chain_mean_accept_length"] for point in points]
    tau.bar(names, taus, yerr=[[value - point["chain_mean_accept_length_interval"][0] for value, point in
                                zip(taus, points)],
                               [point["chain_mean_accept_length_interval"][1] - value for value, point in
                                zip(taus, points)]], capsize=4)
    tau.set(ylabel="chain mean accept length (tau)", title="held-out accept length",
            ylim=(1.0, max(1.05, max(point["chain_mean_accept_length"] for point in points) * 1.02)))
    first.bar(names, [point["chain_acceptance_by_depth"][0] for point in points])
    first.set(ylabel="acceptance at depth 1", title="held-out depth-1 acceptance")
    for axis in (tau, first):
        axis.tick_params(axis="x", rotation=30)
        axis.grid(alpha=0.3, axis="y")
    return save_figure(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--recipe", action="append", required=True, help="NAME:section.field=value,...")
    parser.add_argument("overrides", nargs="*", help="section.field=value for every recipe")
    args = parser.parse_args()
    recipes = [parse_recipe(text) for text in args.recipe]
    names = [name for name, _ in recipes]
    if len(set(names)) != len(names):
        raise SystemExit(f"recipe names repeat: {names}")
    run_cfg = load_config(args.config, args.overrides)
    run_dir = run_cfg.output_path
    if not (run_dir / "features" / "manifest.json").is_file():
        raise SystemExit(f"{run_dir}: no features/manifest.json; run the pipeline up to capture first")
    sweep_dir = run_dir / "recipe-sweep"
    points = []
    for name, overrides in recipes:
        directory = (sweep_dir / name).resolve()
        cfg = subrun_config(args.config, [*args.overrides, *overrides], directory, f"recipe-{name}")
        if not (directory / POINT_FILE).is_file():
            link_run_inputs(run_dir, directory)
            link_run_features(run_dir, directory)
        point = measure_point(cfg, {"recipe": name, "overrides": overrides})
        points.append(point)
        versus = f"  vs {points[0]['recipe']} {paired_against(point, points[0]).describe()} (paired)" \
            if len(points) > 1 else ""
        print(f"{name:<14} tau {describe_tau(point)}{versus}  by depth "
              f"{[round(rate, 3) for rate in point['chain_acceptance_by_depth']]}  "
              f"train {point['train_seconds']:.0f}s  predicted speedup {point['predicted_speedup_by_k']}",
              flush=True)
    json_path = sweep_dir / "recipe_sweep.json"
    best = max(points, key=lambda point: point["chain_mean_accept_length"])
    differences = {point["recipe"]: paired_against(point, points[0]).as_json() for point in points[1:]}
    write_json(json_path, {"config": str(args.config), "overrides": args.overrides, "best": best["recipe"],
                           "paired_against_first": differences, "points": points})
    png_path = plot_recipes(points, sweep_dir / "recipe_sweep.png")
    if run_cfg.tracking.enabled:
        log_points(run_cfg, "recipe-sweep", points, [json_path, png_path])
    print(json.dumps({"best": best["recipe"], "recipe_sweep": str(json_path), "plot": str(png_path)}))


if __name__ == "__main__":
    main()
