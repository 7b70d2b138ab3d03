"""The trainer's data path at 1x and 8x the shards: peak RSS and tokens/s, memory-mapped vs whole-shard reads.

    .venv/bin/python benchmarks/feature_streaming.py [--config params.yaml] [--batches 64] [--rounds 2] [overrides]

Takes a finished run's train features (`make run` first) and lays out two feature folders of hard links: 1x (the
run's shards) and 8x (every shard linked 8 times, the manifest listing each copy). Each case runs in a fresh
process, which opens the FeatureSet, plans the first epoch as the trainer does (`epoch_batches` with
`training.tokens_per_step` and `training.shuffle_buffer_shards`) and reads the first `--batches` batches, the same
number of tokens in both cases. Two readers: `mapped` (FeatureSet: record by record from memory-mapped shards, at
most OPEN_SHARDS open) and `whole` (every shard switch loads the whole shard, as the reader before did). The
cases alternate over the rounds; printed are the medians with their spread, and the 8x/1x ratios of each reader.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from contract.config_loading import load_config
from tasks.common.artifacts import link_or_copy, write_json
from tasks.features.shards import FeatureSet, load_shard
from tasks.training.batch_plan import epoch_batches

COPIES = {"1x": 1, "8x": 8}
READERS = ("mapped", "whole")


def lay_out(features_dir: Path, destination: Path, copies: int) -> Path:
    """A features folder whose train split lists each of the run's shards `copies` times (hard links)."""
    manifest = json.loads((features_dir / "manifest.json").read_text())
    split = manifest["splits"]["train"]
    entries = []
    for copy in range(copies):
        for entry in split["shards"]:
            name = f"train/shard-{len(entries):05d}.safetensors"
            link_or_copy(features_dir / entry["file"], destination / name)
            entries.append({**entry, "file": name})
    manifest["splits"] = {"train": {**split, "shards": entries, "records": split["records"] * copies,
                                    "tokens": split["tokens"] * copies}}
    write_json(destination / "manifest.json", manifest)
    return destination


class WholeShardReader:
    """The reader before memory-mapping: one whole shard in memory, loaded again whenever a record lies in another."""

    def __init__(self, features: FeatureSet) -> None:
        self.features = features
        self.current: tuple[int, dict[str, Any], list[str]] | None = None

    def record(self, position: int) -> dict[str, Any]:
        shard = next(index for index, start in enumerate(self.features._starts[1:]) if position < start)
        if self.current is None or self.current[0] != shard:
            tensors, record_ids, _ = load_shard(self.features.shards[shard].path, self.features.mode)
            self.current = (shard, tensors, record_ids)
        _, tensors, record_ids = self.current
        local = position - self.features._starts[shard]
        start, end = int(tensors["offsets"][local]), int(tensors["offsets"][local + 1])
        return {"id": record_ids[local], **{n: t[start:end] for n, t in tensors.items() if n != "offsets"}}


def child(features_dir: Path, reader: str, batches: int, tokens_per_step: int, buffer_shards: int, seed: int) -> None:
    """One measurement in this fresh process; prints a JSON line."""
    baseline_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    features = FeatureSet(features_dir, "train")
    index = features.index()
    plan = epoch_batches([length for _, length in index], tokens_per_step, seed, 0, features.shard_of(),
                         buffer_shards)[:batches]
    whole = WholeShardReader(features)
    started = time.perf_counter()
    tokens = 0
    checksum = 0.0
    for batch in plan:
        records = features.records(batch) if reader == "mapped" else [whole.record(p) for p in batch]
        tokens += sum(int(record["input_ids"].numel()) for record in records)
        for record in records:  # every byte of the batch is read, as the trainer's collate reads it
            checksum += sum(float(value.float().sum()) for name, value in record.items() if name != "id")
    seconds = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"tokens": tokens, "seconds": seconds, "peak_rss_mib": peak_kib / 1024, "checksum": checksum,
                      "growth_mib": (peak_kib - baseline_kib) / 1024, "shards": len(features.shards)}))


def measure(case_dir: Path, reader: str, args: argparse.Namespace, training: Any, seed: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", str(case_dir), "--reader", reader, "--batches", str(args.batches),
               "--tokens-per-step", str(training.tokens_per_step), "--buffer-shards",
               str(training.shuffle_buffer_shards), "--seed", str(seed)]
    completed = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def spread(values: list[float], unit: str) -> str:
    return f"{statistics.median(values):8.1f} {unit} (min {min(values):.1f}, max {max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("params.yaml"))
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reader", choices=READERS, default="mapped", help=argparse.SUPPRESS)
    parser.add_argument("--tokens-per-step", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--buffer-shards", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.reader, args.batches, args.tokens_per_step, args.buffer_shards, args.seed)
        return

    cfg = load_config(args.config, args.overrides)
    features_dir = cfg.output_path / "features"
    if not (features_dir / "manifest.json").is_file():
        raise SystemExit(f"{features_dir}/manifest.json is missing: run the pipeline first (make run)")
    work = cfg.output_path / "benchmarks" / "feature_streaming"
    shutil.rmtree(work, ignore_errors=True)
    cases = {name: lay_out(features_dir, work / name, copies) for name, copies in COPIES.items()}
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for round_index in range(args.rounds):
        names = list(COPIES) if round_index % 2 == 0 else list(reversed(COPIES))
        for name in names:
            for reader in READERS:
                point = measure(cases[name], reader, args, cfg.training, cfg.runtime.seed)
                results.setdefault((name, reader), []).append(point)
                print(f"round {round_index} {name} {reader:6s}: {point['shards']} shards, "
                      f"{point['tokens'] / point['seconds']:9.0f} tok/s, peak RSS {point['peak_rss_mib']:.0f} MiB "
                      f"(+{point['growth_mib']:.0f} while reading)", flush=True)

    print(f"\n{args.batches} batches of <= {cfg.training.tokens_per_step} tokens per case, {args.rounds} rounds")
    summary: dict[str, Any] = {}
    for reader in READERS:
        for name in COPIES:
            points = results[(name, reader)]
            rates = [p["tokens"] / p["seconds"] for p in points]
            peaks = [p["peak_rss_mib"] for p in points]
            summary[f"{reader}_{name}"] = {"tokens_per_s": statistics.median(rates),
                                            "peak_rss_mib": statistics.median(peaks), "points": points}
            print(f"  {reader:6s} {name}: {spread(rates, 'tok/s')}   peak RSS {spread(peaks, 'MiB')}")
        ratio_rss = summary[f"{reader}_8x"]["peak_rss_mib"] / summary[f"{reader}_1x"]["peak_rss_mib"]
        ratio_rate = summary[f"{reader}_8x"]["tokens_per_s"] / summary[f"{reader}_1x"]["tokens_per_s"]
        print(f"  {reader:6s} 8x/1x: peak RSS {ratio_rss:.2f}x, tokens/s {ratio_rate:.2f}x")
    write_json(work.parent / "feature_streaming.json", summary)
    shutil.rmtree(work)
    print(f"wrote {work.parent / 'feature_streaming.json'}")


if __name__ == "__main__":
    main()
