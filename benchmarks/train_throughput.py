"""Train-stage tokens/s per precision on a finished run's features: the fp32 reference against the candidate.

    .venv/bin/python benchmarks/train_throughput.py [--config params.yaml] [--rounds 3] [--max-steps 40] \
        [--variant fp32:training.precision=fp32 --variant auto:training.precision=auto ...]

Reads a finished run (`make run`, or `eaglet run` up to capture): its target, vocabulary mapping and feature
shards. Each round trains every variant once, in turn (so a shared machine's load falls on all of them alike),
through the train stage's own `run(cfg)` on a fresh sub-run under `<output_dir>/train-throughput/` with
`--max-steps` optimizer steps. Per variant it reports the stage's step rate (tokens/s over the optimizer steps,
the stage's `tokens_per_second`) and the whole stage's rate (tokens trained over the wall time of `run`, which
adds the evaluations, checkpoints and export), as medians over rounds with their spread, and each variant's
ratio to the first one per round. The host's CPU flags are printed beside the figures; the table is written
to `<output_dir>/train-throughput/train_throughput.json`.

`--revision REV` compares code instead of settings: a variant named after REV runs the train stage of that git
revision (a temporary worktree, first on `sys.path` of a fresh process) with the first variant's overrides, and
every variant then runs in a fresh process the same way. REV must read today's config (its schema must accept the
config file), e.g. the commit before a change to the trainer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from recipe_sweep import parse_recipe
from rounds import median_and_range
from contract.config_loading import load_config
from subruns import link_run_features, link_run_inputs, subrun_config
from tasks import train
from tasks.common.artifacts import link_or_copy, write_json
from tasks.common.host_compute import host_compute

REPO_ROOT = Path(__file__).resolve().parents[1]

DEFAULT_VARIANTS = ("fp32:training.precision=fp32", "auto:training.precision=auto")


#: Runs one train stage in a fresh process with the code at argv[1] first on sys.path; prints its summary and time.
STAGE_IN_PROCESS = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from contract.config_loading import load_config
from tasks import train
cfg = load_config(Path(sys.argv[2]), json.loads(sys.argv[3]))
started = time.perf_counter()
values = train.run(cfg).values
print("STAGE " + json.dumps({"seconds": time.perf_counter() - started, "values": values, "code": train.__file__},
                           default=str))
"""


def stage_in_process(code: Path, config: Path, overrides: list[str]) -> tuple[dict[str, Any], float]:
    """(summary, seconds) of the train stage of the code under `code`, run in a fresh process."""
    done = subprocess.run([sys.executable, "-c", STAGE_IN_PROCESS, str(code), str(config), json.dumps(overrides)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the train stage of {code} failed:\n{done.stderr[-3000:]}")
    line = [text for text in done.stdout.splitlines() if text.startswith("STAGE ")][-1]
    result = json.loads(line.removeprefix("STAGE "))
    if not Path(result["code"]).resolve().is_relative_to(code.resolve()):
        raise SystemExit(f"the train stage ran from {result['code']}, not from {code}")
    return result["values"], result["seconds"]


def train_once(config: Path, overrides: list[str], directory: Path, run_id: str,
               code: Optional[Path] = None) -> dict[str, float]:
    """One fresh train stage on the run's features (in this process, or of the code under `code` in a fresh
    one); its step rate and whole-stage rate."""
    if directory.exists():
        shutil.rmtree(directory)
    run_dir = load_config(config).output_path
    link_run_inputs(run_dir, directory)
    link_run_features(run_dir, directory)
    link_or_copy(run_dir / "features" / "manifest.json", directory / "features" / "manifest.json")
    if code is None:
        cfg = subrun_config(config, overrides, directory, run_id)
        started = time.perf_counter()
        summary = train.run(cfg).values
        seconds = time.perf_counter() - started
    else:
        summary, seconds = stage_in_process(code, config, [*overrides, f"output_dir={directory}", f"run_id={run_id}",
                                                           "tracking.enabled=false"])
    steps = json_lines(directory / "train" / "steps.jsonl")
    tokens = sum(step["tokens"] for step in steps) if all("tokens" in step for step in steps) else None
    shutil.rmtree(directory / "checkpoints", ignore_errors=True)  # the weights are not what is measured
    return {"step_tokens_per_second": summary["tokens_per_second"], "tokens": tokens,
            "stage_tokens_per_second": tokens / seconds if tokens is not None else None,
            "stage_seconds": seconds, "steps": summary["steps"], "precision": summary.get("precision", "unrecorded")}


def credit_tokens(points: list[dict[str, Any]]) -> None:
    """Stage rates for the points of one round whose code logged no per-step token counts (older revisions): they
    trained the tokens the others did, the same features through the same batch plan with the same seed, which
    their equal step count confirms."""
    counted = [point for point in points if point["tokens"] is not None]
    for point in points:
        if point["tokens"] is not None:
            continue
        peers = [peer for peer in counted if peer["steps"] == point["steps"]]
        if not peers:
            raise SystemExit("a variant logged no per-step token counts and no other trained the same steps")
        point["tokens"] = peers[0]["tokens"]
        point["stage_tokens_per_second"] = point["tokens"] / point["stage_seconds"]


def json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("params.yaml"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--variant", action="append", default=None,
                        help="NAME:section.field=value[,...]; the first is the baseline (default: fp32, auto)")
    parser.add_argument("--revision", default=None, help="a git revision whose train stage is the baseline")
    args = parser.parse_args()
    variants = [parse_recipe(text) for text in (args.variant or DEFAULT_VARIANTS)]
    root = load_config(args.config).output_path / "train-throughput"
    codes: dict[str, Optional[Path]] = {name: None for name, _ in variants}
    if args.revision:
        worktree = Path(tempfile.mkdtemp(prefix="eaglet-revision-")) / "code"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.revision], check=True)
        variants.insert(0, (args.revision, variants[0][1]))
        codes = {name: REPO_ROOT for name, _ in variants} | {args.revision: worktree}
    try:
        measure(args, variants, codes, root)
    finally:
        if args.revision:
            subprocess.run(["git", "worktree", "remove", "--force", str(codes[args.revision])], check=False)


def measure(args: argparse.Namespace, variants: list[tuple[str, list[str]]], codes: dict[str, Optional[Path]],
            root: Path) -> None:
    """The rounds, the table and its JSON."""
    common = [f"training.max_steps={args.max_steps}", "training.resume_from=none",
              f"training.eval_interval={args.max_steps}", f"training.save_interval={args.max_steps}"]
    print(f"host: {host_compute().describe()}", flush=True)
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in variants}
    for round_index in range(args.rounds):
        points = {name: train_once(args.config, [*common, *overrides], root / name, f"throughput-{name}", codes[name])
                  for name, overrides in variants}
        credit_tokens(list(points.values()))
        for name, point in points.items():
            results[name].append(point)
            print(f"round {round_index + 1} {name:>10} ({point['precision']}): step {point['step_tokens_per_second']:.0f} "
                  f"tok/s, stage {point['stage_tokens_per_second']:.0f} tok/s ({point['stage_seconds']:.1f} s)", flush=True)
    baseline = variants[0][0]
    print(f"\n{'variant':>10} {'step tok/s (median [min-max])':>32} {'stage tok/s':>26} {'step ratio':>22} "
          f"{'stage ratio':>22}")
    table = {}
    for name, _ in variants:
        step_ratio = [point["step_tokens_per_second"] / base["step_tokens_per_second"]
                      for point, base in zip(results[name], results[baseline])]
        stage_ratio = [point["stage_tokens_per_second"] / base["stage_tokens_per_second"]
                       for point, base in zip(results[name], results[baseline])]
        print(f"{name:>10} {median_and_range([p['step_tokens_per_second'] for p in results[name]]):>32} "
              f"{median_and_range([p['stage_tokens_per_second'] for p in results[name]]):>26} "
              f"{median_and_range(step_ratio):>22} {median_and_range(stage_ratio):>22}")
        table[name] = {"rounds": results[name], "step_ratio": step_ratio, "stage_ratio": stage_ratio}
    write_json(root / "train_throughput.json", {"host": host_compute().as_record(), "max_steps": args.max_steps,
                                                "baseline": baseline, "revision": args.revision, "variants": table})


if __name__ == "__main__":
    main()
