"""Regeneration schedules on one live engine: rounds (turn k of a chunk together) vs streaming records.

    .venv/bin/python benchmarks/regenerate_schedules.py --config params.yaml [--records 48] [--rounds 2] \
        [--concurrency 16 32] [--schedules rounds stream] [--engine-env KEY=VALUE ...]

Reads a run that has been through `target` and `ingest` (its `data/prompts.jsonl`, multi-turn records as the
stage sends them). Starts the regeneration engine of the config once (`regeneration.engine`, with
`--engine-env` added to its environment) and regenerates the first `--records` records with each schedule and
concurrency, alternating them round after round so a noisy shared machine hits all alike:

  rounds@C   the local backend's schedule over the server: chunks of `regeneration.chunk_records`, turn k of
             every record of a chunk sent together (C in flight), the next turn after the slowest answer;
  stream@C   what the stage does with a server: C records in flight, each sending its next turn as soon as
             its previous one is written.

Prints completion tokens/s per round, medians with their spread, each schedule's ratio to rounds at the first
concurrency, and how many records came out identical to the first variant's (greedy: all of them should).
Writes `<output_dir>/benchmarks/regenerate_schedules.json`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from contract.config import RunConfig
from contract.config_loading import load_config
from contract.secrets import redacted_mapping
from regenerate_backends import spread
from tasks import regenerate
from tasks.common.artifacts import read_json, write_json
from tasks.data.generation_openai import OpenAIGenerator
from tasks.serving.engine import serve


def with_concurrency(cfg: RunConfig, concurrency: int) -> RunConfig:
    return cfg.model_copy(update={"regeneration": cfg.regeneration.model_copy(update={"concurrency": concurrency})})


def regenerate_once(cfg: RunConfig, schedule: str, base_url: str, todo: list[tuple[str, Any]],
                    params: Any) -> tuple[float, dict[str, Any]]:
    """Completion tokens/s of one pass, and the entries by key."""
    generator = OpenAIGenerator(base_url, cfg.regeneration)
    stats = {"completion_tokens": 0.0, "generation_seconds": 0.0, "records": 0.0}
    entries: dict[str, Any] = {}

    def keep(batch: list[dict[str, Any]]) -> None:
        entries.update((entry["key"], entry) for entry in batch)

    started = time.perf_counter()
    if schedule == "stream":
        regenerate.stream_records(todo, generator, cfg, params, stats, keep)
    else:
        for chunk in regenerate.chunks(todo, cfg.regeneration.chunk_records):
            keep(regenerate.regenerate_chunk(chunk, generator, cfg, params, stats))
    seconds = time.perf_counter() - started
    failed = [entry for entry in entries.values() if entry["outcome"]["status"] != "ok"]
    if failed:
        raise RuntimeError(f"{schedule}: {len(failed)} records failed, first: {failed[0]['outcome']}")
    return stats["completion_tokens"] / seconds, entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--records", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16])
    parser.add_argument("--schedules", nargs="+", choices=("rounds", "stream"), default=["rounds", "stream"])
    parser.add_argument("--engine-env", nargs="*", default=[], help="KEY=VALUE added to the engine's environment")
    args = parser.parse_args()
    cfg = load_config(args.config, [])
    settings = cfg.regeneration
    if settings.backend != "openai" or settings.base_url or not settings.engine:
        raise SystemExit("the config must regenerate through an engine started for the stage "
                         "(regeneration.backend openai, regeneration.engine set, no base_url)")
    out = cfg.output_path
    todo = regenerate.read_prompts(out / "data" / "prompts.jsonl")[:args.records]
    params = regenerate.generation_params(cfg, read_json(out / "target.json"))
    launch = regenerate.regeneration_launch(cfg, out / "logs" / "regenerate-schedules.log")
    measured_env = dict(item.split("=", 1) for item in args.engine_env)
    launch.env.update(measured_env)
    shown_env = {**redacted_mapping(launch.env), **measured_env}  # the config's values are secret, ours are not
    variants = [(schedule, concurrency) for concurrency in args.concurrency for schedule in args.schedules]
    rates: dict[str, list[float]] = {f"{schedule}@{c}": [] for schedule, c in variants}
    outputs: dict[str, dict[str, Any]] = {}
    print(f"{len(todo)} records, max_new_tokens {settings.max_new_tokens}, chunk_records {settings.chunk_records}, "
          f"engine env {shown_env}")
    with serve(launch) as engine:
        regenerate_once(with_concurrency(cfg, 4), "stream", engine.base_url, todo[:4], params)  # warm-up
        for round_index in range(args.rounds):
            for schedule, concurrency in variants:
                name = f"{schedule}@{concurrency}"
                rate, outputs[name] = regenerate_once(with_concurrency(cfg, concurrency), schedule, engine.base_url,
                                                      todo, params)
                rates[name].append(rate)
                print(f"round {round_index + 1} {name:>10}: {rate:6.1f} tok/s", flush=True)
    first = next(iter(outputs))
    reference = statistics.median(rates[first])
    summary = {}
    for name, values in rates.items():
        same = sum(outputs[name][key].get("record") == outputs[first][key].get("record") for key in outputs[first])
        summary[name] = {"tokens_per_s": values, "median": statistics.median(values),
                         f"ratio_to_{first}": statistics.median(values) / reference, "identical_records": same}
        print(f"{name:>10}: {spread(values)}; {statistics.median(values) / reference:.2f}x {first}; "
              f"identical records {same}/{len(todo)}")
    write_json(out / "benchmarks" / "regenerate_schedules.json",
               {"records": len(todo), "engine_env": shown_env, "variants": summary})


if __name__ == "__main__":
    main()
