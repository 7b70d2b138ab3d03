"""Local regeneration throughput: batched generation vs one request at a time, on the same prompts.

    .venv/bin/python benchmarks/regenerate_batching.py [--prompts 16] [--batch 16] [--max-new-tokens 64]

Uses the embedded target (SmolLM2-135M-Instruct, materialised once) and MT-bench first turns.
Target: batched tokens/s >= 3x one-at-a-time on a 2-core CPU. Prints both and the ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from contract.config import RegenerationConfig, RunConfig
from tasks import target
from tasks.common.assets import asset_path
from tasks.data.generation import GenerationRequest
from tasks.data.generation_local import LocalGenerator


def mtbench_requests(count: int) -> list[GenerationRequest]:
    lines = asset_path("mtbench").read_text(encoding="utf-8").splitlines()[:count]
    questions = [json.loads(line) for line in lines]
    return [GenerationRequest(str(q["question_id"]), 1, [{"role": "user", "content": q["turns"][0]}], 0) for q in questions]


def tokens_per_second(generator: LocalGenerator, requests: list[GenerationRequest]) -> tuple[float, int]:
    started = time.perf_counter()
    replies = generator.generate(requests)
    seconds = time.perf_counter() - started
    tokens = sum(reply.completion_tokens for reply in replies)
    return tokens / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output-dir", default=None, help="run dir holding (or to hold) target/")
    args = parser.parse_args()
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="eaglet-bench-")
    target_dir = target.run(RunConfig.model_validate({"output_dir": output_dir})).directory
    requests = mtbench_requests(args.prompts)
    print(f"torch threads: {torch.get_num_threads()}, prompts: {len(requests)}, max_new_tokens: {args.max_new_tokens}")
    results = {}
    for batch in (1, args.batch):
        settings = RegenerationConfig(batch_size=batch, max_new_tokens=args.max_new_tokens)
        generator = LocalGenerator(Path(target_dir), settings)
        rate, tokens = tokens_per_second(generator, requests)
        results[batch] = rate
        print(f"batch {batch:>3}: {rate:8.2f} tokens/s ({tokens} tokens)")
    ratio = results[args.batch] / results[1]
    print(f"ratio batched/one-at-a-time: {ratio:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
