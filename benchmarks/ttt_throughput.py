"""TTT training-step throughput of the SmolLM2-sized draft (batch 1), eaglet per precision vs a dense fp32 baseline.

    .venv/bin/python benchmarks/ttt_throughput.py [--lengths 512 1024] [--draft-vocab 8192 32000] [--rounds 3] \
        [--ttt-length 7]

One step = teacher from the target's final hidden states (full-vocab lm_head), `--ttt-length` unrolled draft steps,
backward, AdamW update, on a sequence whose first 37% is prompt (unsupervised), as in the embedded run. The baseline,
measured in the same run on the same shapes, is the straightforward form in fp32: the whole fp32 teacher, a dense
[T, (k+1)T] masked score matrix at every step k (the approach of SpecForge's trainer) and every metric. eaglet runs
as its trainer does: the fused attention, the teacher in the compute dtype, loss and accuracy only, in fp32 and in
the precision `training.precision: auto` picks on this host. Rounds alternate the variants; the script prints the
median rate of each and its ratio to the baseline per round (median [min-max]), beside the host's CPU flags.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

import models.ttt as ttt
from rounds import median_and_range
from models.eagle3 import Eagle3Config, Eagle3Draft
from models.teacher import Teacher
from models.ttt import TTTBatch, ttt_forward
from tasks.common.devices import autocast, compute_dtype
from tasks.common.host_compute import host_compute

PROMPT_SHARE = 0.37  # unsupervised share of tokens in the embedded run's train features (1 - 8154/12936)
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, vocab_size=49152,
               target_hidden_size=576, aux_layer_ids=[1, 14, 26])


FUSED = ttt.causal_plus_diagonal_attention


def dense_attend(queries, keys0, values0, diagonal_keys, diagonal_values, backend="sdpa"):
    """Baseline: all keys so far concatenated, one dense boolean mask per step."""
    groups = queries.shape[1] // keys0.shape[1]
    keys = torch.cat([keys0, *diagonal_keys], dim=2).repeat_interleave(groups, 1)
    values = torch.cat([values0, *diagonal_values], dim=2).repeat_interleave(groups, 1)
    length = queries.shape[2]
    blocks = [torch.ones(length, length, dtype=torch.bool).tril()]
    blocks += [torch.eye(length, dtype=torch.bool)] * len(diagonal_keys)
    return torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=torch.cat(blocks, dim=1))


@dataclass(frozen=True)
class Variant:
    name: str
    attention: Callable[..., torch.Tensor]
    dtype: torch.dtype
    expected_acceptance: bool


def step_seconds(draft: Eagle3Draft, teacher: Teacher, length: int, steps: int, variant: Variant) -> float:
    """Seconds of one training step (teacher, forward, backward, AdamW) after one warm-up step."""
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    hidden = torch.randn(1, length, 576)
    mask = torch.ones(1, length, dtype=torch.long)
    mask[:, : int(length * PROMPT_SHARE)] = 0
    ttt.causal_plus_diagonal_attention = variant.attention
    timings = []
    try:
        for _ in range(2):
            started = time.perf_counter()
            probs, top1, in_draft = teacher(hidden)
            aux = torch.randn(1, length, 3 * 576).to(variant.dtype)
            batch = TTTBatch(torch.randint(0, 49152, (1, length)), mask, aux, probs, top1, in_draft)
            optimizer.zero_grad()
            with autocast(torch.device("cpu"), variant.dtype):
                loss = ttt_forward(draft, batch, steps=steps, expected_acceptance=variant.expected_acceptance).loss
            loss.backward()
            optimizer.step()
            timings.append(time.perf_counter() - started)
    finally:
        ttt.causal_plus_diagonal_attention = FUSED
    return timings[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--draft-vocab", type=int, nargs="+", default=[8192, 32000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttt-length", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    lm_head = torch.randn(49152, 576) * 0.02
    auto = compute_dtype("auto", torch.device("cpu"))
    variants = [Variant("dense fp32", dense_attend, torch.float32, True),
                Variant("eaglet fp32", FUSED, torch.float32, False),
                Variant(f"eaglet auto ({str(auto).removeprefix('torch.')})", FUSED, auto, False)]
    print(f"host: {host_compute().describe()}; batch 1, L={args.ttt_length}, {args.rounds} alternating rounds")
    for vocab in args.draft_vocab:
        draft = Eagle3Draft(Eagle3Config(draft_vocab_size=vocab, **SMOLLM2))
        draft.attach_embedding(torch.randn(49152, 576) * 0.02)
        t2d = torch.zeros(49152, dtype=torch.bool)
        t2d[:vocab] = True
        draft.set_vocab_mapping(torch.zeros(vocab, dtype=torch.int64), t2d)
        teachers = {variant.dtype: Teacher(lm_head, t2d, variant.dtype) for variant in variants}
        for length in args.lengths:
            rates: dict[str, list[float]] = {variant.name: [] for variant in variants}
            for _ in range(args.rounds):
                for variant in variants:
                    seconds = step_seconds(draft, teachers[variant.dtype], length, args.ttt_length, variant)
                    rates[variant.name].append(length / seconds)
            baseline = rates[variants[0].name]
            for variant in variants:
                ratios = [rate / base for rate, base in zip(rates[variant.name], baseline)]
                print(f"Vd={vocab:>5} T={length:>5} {variant.name:>22}: {statistics.median(rates[variant.name]):7.1f} "
                      f"tok/s, x{median_and_range(ratios, 2)} the dense fp32 baseline")


if __name__ == "__main__":
    main()
