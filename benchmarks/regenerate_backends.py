"""Regeneration throughput by backend: the vLLM engine vs the local transformers backend, same prompts.

    .venv/bin/python benchmarks/regenerate_backends.py [--prompts 32] [--max-new-tokens 128] [--rounds 3]

Uses the embedded target (SmolLM2-135M-Instruct, materialised once) and the first user turns of FastChat's
ShareGPT sample and HumanEval (training-side prompts, greedy, as the regenerate stage sends them). Both
backends are built exactly as the regenerate stage builds them (`regeneration.backend` local, batched; or
openai with `regeneration.engine: vllm`, the engine started once and kept up). The rounds alternate local and
engine so that a noisy shared machine hits both alike; the script prints tokens/s per round, the medians with
their spread, the engine/local ratio of the medians, the engine's start-up time, and how many replies are
token-for-token identical between the backends (greedy: they should all be).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import tempfile
import time
from pathlib import Path

from contract.config import RegenerationConfig, RunConfig
from tasks import target
from tasks.common.assets import asset_path
from tasks.data.generation import GenerationReply, GenerationRequest, Generator
from tasks.data.generation_local import LocalGenerator
from tasks.data.generation_openai import OpenAIGenerator
from tasks.serving.engine import EngineLaunch, serve


def training_requests(count: int) -> list[GenerationRequest]:
    """First user turns of distinct ShareGPT-sample conversations, then HumanEval prompts."""
    prompts: list[str] = []
    for conversation in json.loads(asset_path("sharegpt-dummy").read_text(encoding="utf-8")):
        first = conversation["conversations"][0]["value"]
        if first not in prompts:
            prompts.append(first)
    with gzip.open(asset_path("humaneval"), "rt", encoding="utf-8") as handle:
        prompts += [json.loads(line)["prompt"] for line in handle if line.strip()]
    return [GenerationRequest(f"p{index}", 1, [{"role": "user", "content": text}], 0)
            for index, text in enumerate(prompts[:count])]


def embedded_target(output_dir: str | None, prompts: int) -> tuple[Path, RunConfig, Path, list[GenerationRequest]]:
    """(run dir, its default config, the materialised embedded target, the first `prompts` training requests)."""
    run_dir = Path(output_dir or tempfile.mkdtemp(prefix="eaglet-bench-"))
    cfg = RunConfig.model_validate({"output_dir": str(run_dir)})
    return run_dir, cfg, target.run(cfg).directory, training_requests(prompts)


def timed(generator: Generator, requests: list[GenerationRequest]) -> tuple[float, list[GenerationReply]]:
    started = time.perf_counter()
    replies = generator.generate(requests)
    seconds = time.perf_counter() - started
    failed = [reply for reply in replies if reply.error]
    if failed:
        raise RuntimeError(f"{generator.backend}: {len(failed)} failed replies, first: {failed[0].error}")
    return sum(reply.completion_tokens for reply in replies) / seconds, replies


def spread(rates: list[float]) -> str:
    return f"median {statistics.median(rates):7.1f} tok/s (min {min(rates):.1f}, max {max(rates):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="local backend batch size")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight to the engine")
    parser.add_argument("--output-dir", default=None, help="run dir holding (or to hold) target/")
    args = parser.parse_args()
    output_dir, cfg, target_dir, requests = embedded_target(args.output_dir, args.prompts)
    settings = RegenerationConfig(backend="openai", engine="vllm", max_new_tokens=args.max_new_tokens,
                                  batch_size=args.batch, concurrency=args.concurrency)
    print(f"prompts {len(requests)}, max_new_tokens {args.max_new_tokens}, greedy, rounds {args.rounds}")
    local = LocalGenerator(target_dir, settings, cfg.model.dtype)
    launch = EngineLaunch.from_config("vllm", cfg.runtime.engines["vllm"], model=target_dir,
                                      log_path=output_dir / "logs" / "regenerate-backends-vllm.log")
    started = time.perf_counter()
    with serve(launch) as engine:
        startup = time.perf_counter() - started
        remote = OpenAIGenerator(engine.base_url, settings)
        timed(remote, requests[:2])  # the engine's first requests pay one-off warm-up
        rates: dict[str, list[float]] = {"local": [], "engine": []}
        replies: dict[str, list[GenerationReply]] = {}
        for round_index in range(args.rounds):
            for name, generator in (("local", local), ("engine", remote)):
                rate, replies[name] = timed(generator, requests)
                rates[name].append(rate)
                print(f"round {round_index + 1} {name:>6}: {rate:7.1f} tok/s", flush=True)
    same = sum(a.text == b.text for a, b in zip(replies["local"], replies["engine"]))
    print(f"local  (batch {args.batch}):        {spread(rates['local'])}")
    print(f"engine (vLLM, concurrency {args.concurrency}): {spread(rates['engine'])}; ready after {startup:.0f} s")
    ratio = statistics.median(rates["engine"]) / statistics.median(rates["local"])
    print(f"engine / local (medians): {ratio:.2f}x; identical greedy replies: {same}/{len(requests)}")


if __name__ == "__main__":
    main()
