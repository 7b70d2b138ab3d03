"""Capture throughput by backend: the target in-process (local) vs the vLLM server (capture.backend vllm).

    .venv/bin/python benchmarks/capture_backends.py [--config params.yaml] [--records 64] [--rounds 3] [overrides]

Takes the first N train records of a finished run (`make run` first; the run's config names its output
directory) and runs the capture stage's own `run(cfg)` on them with each backend, each round into fresh folders
(nothing is kept between rounds), alternating which backend goes first so a noisy shared machine hits both
alike. Prints tokens/s per round while the states are computed (the target loaded, the engine ready), the
medians with their spread and the vllm/local ratio, the stage's wall time (with the engine's start), and the
engine's in-process verification: the largest relative difference per state slot. Writes
`<output_dir>/benchmarks/capture_backends.json`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from subruns import link_run_inputs, subrun_config
from contract.config_loading import load_config
from tasks import capture
from tasks.common.artifacts import write_json
from tasks.serving.engine import free_port

BACKENDS = ("local", "vllm")


def measure(config: Path, overrides: list[str], run_dir: Path, train_records: list[Any], folder: Path, backend: str,
            verify_fraction: float) -> dict[str, Any]:
    """One capture stage run with `backend` into `folder` (removed afterwards)."""
    overrides = [*overrides, f"capture.backend={backend}", f"capture.verify_fraction={verify_fraction}",
                 f"runtime.engines.vllm.port={free_port()}", "capture.engine_env.VLLM_CPU_NUM_OF_RESERVED_CPU=0"]
    cfg = subrun_config(config, overrides, folder, f"capture-{backend}")
    link_run_inputs(run_dir, folder, train_records)
    started = time.perf_counter()
    result = capture.run(cfg)
    wall = time.perf_counter() - started
    metrics = result.report.metrics
    point = {"backend": backend, "tokens": metrics["tokens"], "wall_s": wall,
             "tokens_per_s": metrics["capture_tokens_per_second"], "producer": result.manifest["producer"]}
    shutil.rmtree(folder)
    return point


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):7.1f} (min {min(values):.1f}, max {max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("params.yaml"))
    parser.add_argument("--records", type=int, default=64, help="train records captured per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--verify-fraction", type=float, default=0.05)
    parser.add_argument("overrides", nargs="*", help="section.field=value (e.g. output_dir= of the run to read)")
    args = parser.parse_args()

    run_dir = load_config(args.config, args.overrides).output_path
    train_file = run_dir / "data" / "train.jsonl"
    if not train_file.is_file():
        raise SystemExit(f"{train_file} is missing: run the pipeline first (make run, or eaglet run --config "
                         f"{args.config})")
    lines = train_file.read_text(encoding="utf-8").splitlines()[: args.records]
    train_records = [json.loads(line) for line in lines]
    work = run_dir / "benchmarks" / "capture_backends"
    points: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        order = BACKENDS if round_index % 2 == 0 else tuple(reversed(BACKENDS))
        for backend in order:
            point = measure(args.config, args.overrides, run_dir, train_records, work / f"round{round_index}-{backend}", backend,
                            args.verify_fraction)
            point["round"] = round_index
            points.append(point)
            print(f"round {round_index} {backend:5s}: {point['tokens_per_s']:7.1f} tok/s while capturing, "
                  f"stage {point['wall_s']:6.1f} s for {point['tokens']:.0f} tokens", flush=True)

    rates = {backend: [p["tokens_per_s"] for p in points if p["backend"] == backend] for backend in BACKENDS}
    walls = {backend: [p["wall_s"] for p in points if p["backend"] == backend] for backend in BACKENDS}
    ratio = statistics.median(rates["vllm"]) / statistics.median(rates["local"])
    print(f"\n{len(train_records)} records, {points[0]['tokens']:.0f} tokens per round (train + eval splits)")
    for backend in BACKENDS:
        print(f"  {backend:5s} tok/s {spread(rates[backend])}   stage wall s {spread(walls[backend])}")
    print(f"  vllm / local (medians of tok/s while capturing): {ratio:.2f}x")
    verified = [p["producer"].get("verify", {}) for p in points if p["backend"] == "vllm"]
    worst: dict[str, float] = {}
    for verify in verified:
        for slot in verify.get("slots", []):
            worst[slot["slot"]] = max(worst.get(slot["slot"], 0.0), slot["max_relative_difference"])
    print("  engine vs in-process, largest relative difference per slot: "
          + ", ".join(f"{slot} {value:.1e}" for slot, value in worst.items()))
    summary = {"records": len(train_records), "rounds": args.rounds, "points": points,
               "median_tokens_per_s": {b: statistics.median(rates[b]) for b in BACKENDS},
               "vllm_over_local": ratio, "verify_max_relative_difference": worst}
    write_json(run_dir / "benchmarks" / "capture_backends.json", summary)
    print(f"wrote {run_dir / 'benchmarks' / 'capture_backends.json'}")


if __name__ == "__main__":
    main()
