"""Regeneration throughput of vLLM's engine per dtype: the same prompts, the engine in float32 and in bfloat16.

    .venv/bin/python benchmarks/regenerate_dtypes.py [--prompts 64] [--max-new-tokens 128] [--rounds 3]

The engines are started exactly as the regenerate stage starts them (`regeneration.backend: openai`,
`regeneration.engine: vllm`, every core), one per dtype, both kept up; the rounds alternate the dtypes so that a
noisy shared machine hits both alike. Prints the host's CPU flags, tokens/s per round, medians with their spread,
the bfloat16/float32 ratio of the medians, and how many greedy replies are identical between the two dtypes
(bfloat16 rounds differently, so replies drift apart after a while: that share is the price of the speed).
"""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack
from pathlib import Path

from regenerate_backends import embedded_target, timed
from rounds import median_and_range
from contract.config import RegenerationConfig
from tasks.common.host_compute import host_compute
from tasks.data.generation import GenerationReply
from tasks.data.generation_openai import OpenAIGenerator
from tasks.serving.engine import EngineLaunch, free_port, serve

ALL_CORES = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight to the engine")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--output-dir", default=None, help="run dir holding (or to hold) target/")
    args = parser.parse_args()
    output_dir, cfg, target_dir, requests = embedded_target(args.output_dir, args.prompts)
    settings = RegenerationConfig(backend="openai", engine="vllm", max_new_tokens=args.max_new_tokens,
                                  concurrency=args.concurrency)
    print(f"host: {host_compute().describe()}")
    print(f"prompts {len(requests)}, max_new_tokens {args.max_new_tokens}, greedy, concurrency {args.concurrency}, "
          f"rounds {args.rounds}")
    rates: dict[str, list[float]] = {dtype: [] for dtype in args.dtypes}
    replies: dict[str, list[GenerationReply]] = {}
    with ExitStack() as stack:
        generators: dict[str, OpenAIGenerator] = {}
        for dtype in args.dtypes:
            launch = EngineLaunch.from_config("vllm", cfg.runtime.engines["vllm"], model=target_dir,
                                              log_path=output_dir / "logs" / f"regenerate-{dtype}.log")
            launch.port = free_port()
            launch.extra_args += ["--dtype", dtype]
            launch.env.update(ALL_CORES)
            started = time.perf_counter()
            engine = stack.enter_context(serve(launch))
            print(f"{dtype}: ready after {time.perf_counter() - started:.0f} s", flush=True)
            generators[dtype] = OpenAIGenerator(engine.base_url, settings)
            timed(generators[dtype], requests[:2])  # the engine's first requests pay one-off warm-up
        for round_index in range(args.rounds):
            for dtype, generator in generators.items():
                rate, replies[dtype] = timed(generator, requests)
                rates[dtype].append(rate)
                print(f"round {round_index + 1} {dtype:>9}: {rate:7.1f} tok/s", flush=True)
    baseline = args.dtypes[0]
    for dtype in args.dtypes:
        ratios = [rate / base for rate, base in zip(rates[dtype], rates[baseline])]
        same = sum(a.text == b.text for a, b in zip(replies[baseline], replies[dtype]))
        print(f"{dtype:>9}: {median_and_range(rates[dtype])} tok/s, per round {median_and_range(ratios, 2)}x "
              f"{baseline}; identical greedy replies {same}/{len(requests)}")


if __name__ == "__main__":
    main()
