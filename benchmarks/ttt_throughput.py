"""TTT training-step throughput of the SmolLM2-sized draft (batch 1), eaglet per precision vs a dense fp32 baseline.

    .venv/bin/python benchmarks/ttt_throughput.py [--lengths 512 1024] [--draft-vocab 8192 32000] [--rounds 3] \
        [--ttt-length 7] [--device cpu|cuda] [--compile]

One step = teacher from the target's final hidden states (full-vocab lm_head), `--ttt-length` unrolled draft steps,
backward, gradient clipping, AdamW update, on a sequence whose first 37% is prompt (unsupervised), as in the
embedded run. The baseline, measured in the same run on the same shapes, is the straightforward form in fp32: the
whole fp32 teacher, a dense [T, (k+1)T] masked score matrix at every step k and every metric: how an EAGLE3
trainer is first written. It is a proxy only: SpecForge 0.2's own step (whose sdpa backend scores the causal part
with one matmul and each earlier step's diagonal apart) is timed by benchmarks/ttt_vs_specforge.py. eaglet runs as
its trainer does: the fused attention, the teacher in the compute dtype and only at the rows the loss reads
(tasks/features/batches.collate), loss and accuracy only, in fp32 and in the precision `training.precision: auto`
picks on this host; with `--compile` also that precision with the step's dense parts compiled (models/ttt_compile.py;
its warm-up steps, compilation included, are timed and printed apart).
Rounds alternate the variants; the script prints the median rate of each and its ratio to the baseline per round
(median [min-max]), beside the host's CPU flags or the GPU's name.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

import models.ttt as ttt
from rounds import median_and_range
from models.eagle3 import Eagle3Config, Eagle3Draft
from models.teacher import Teacher
from models.ttt import TTTBatch, step_loss, ttt_forward
from models.ttt_compile import compile_draft_parts
from tasks.common.devices import autocast, compute_dtype
from tasks.features.batches import collate
from tasks.common.host_compute import host_compute

MAX_GRAD_NORM = 0.5  # the trainer clips every step (training.max_grad_norm; SpecForge's default too)
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
    blocks = [torch.ones(length, length, dtype=torch.bool, device=queries.device).tril()]
    blocks += [torch.eye(length, dtype=torch.bool, device=queries.device)] * len(diagonal_keys)
    return torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=torch.cat(blocks, dim=1))


@dataclass(frozen=True)
class Variant:
    name: str
    attention: Callable[..., torch.Tensor]
    dtype: torch.dtype
    expected_acceptance: bool
    compiled: bool = False
    taught_rows_only: bool = True  # the trainer's collate; the baseline teaches every row


@dataclass
class Contender:
    """A variant with its own draft (a compiled variant's methods are replaced on its instance), optimizer and loss."""

    variant: Variant
    draft: Eagle3Draft
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = step_loss


def draft_vocabulary(vocab: int) -> torch.Tensor:
    """t2d of a draft vocabulary made of the target's first `vocab` ids (which ids does not change the step's cost)."""
    t2d = torch.zeros(SMOLLM2["vocab_size"], dtype=torch.bool)
    t2d[:vocab] = True
    return t2d


def reference_draft(vocab: int) -> Eagle3Draft:
    """The SmolLM2-shaped EAGLE3 draft every eaglet variant copies, with a random frozen embedding."""
    reference = Eagle3Draft(Eagle3Config(draft_vocab_size=vocab, **SMOLLM2))
    reference.attach_embedding(torch.randn(SMOLLM2["vocab_size"], SMOLLM2["hidden_size"]) * 0.02)
    reference.set_vocab_mapping(torch.zeros(vocab, dtype=torch.int64), draft_vocabulary(vocab))
    return reference


def contender(variant: Variant, reference: Eagle3Draft, device: torch.device) -> Contender:
    draft = copy.deepcopy(reference).to(device)
    draft.attach_embedding(reference.embed_tokens.weight.to(device))
    loss_fn = compile_draft_parts(draft) if variant.compiled else step_loss
    return Contender(variant, draft, torch.optim.AdamW(draft.parameters(), lr=1e-4), loss_fn)


def step_seconds(entry: Contender, teacher: Teacher, length: int, steps: int, device: torch.device,
                 repeats: int = 2) -> float:
    """Seconds of the last of `repeats` training steps (teacher, forward, backward, AdamW)."""
    variant = entry.variant
    hidden = torch.randn(1, length, 576, device=device)
    mask = torch.ones(1, length, dtype=torch.long, device=device)
    mask[:, : int(length * PROMPT_SHARE)] = 0
    ttt.causal_plus_diagonal_attention = variant.attention
    timings = []
    try:
        for _ in range(repeats):
            synchronise(device)
            started = time.perf_counter()
            ids = torch.randint(0, 49152, (1, length), device=device)
            aux = torch.randn(1, length, 3 * 576, device=device).to(variant.dtype)
            if variant.taught_rows_only:
                batch = collate([{"input_ids": ids[0], "loss_mask": mask[0], "hidden_state": hidden[0],
                                  "aux_hidden_state": aux[0]}], teacher)
            else:
                probs, top1, in_draft = teacher(hidden)
                batch = TTTBatch(ids, mask, aux, probs, top1, in_draft)
            entry.optimizer.zero_grad()
            with autocast(device, variant.dtype):
                loss = ttt_forward(entry.draft, batch, steps=steps, expected_acceptance=variant.expected_acceptance,
                                   loss_fn=entry.loss_fn).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(entry.draft.parameters(), MAX_GRAD_NORM)
            entry.optimizer.step()
            synchronise(device)
            timings.append(time.perf_counter() - started)
    finally:
        ttt.causal_plus_diagonal_attention = FUSED
    return timings[-1]


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return host_compute().describe()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--draft-vocab", type=int, nargs="+", default=[8192, 32000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:N]")
    parser.add_argument("--compile", action="store_true", help="add the auto precision with compiled dense parts")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    lm_head = (torch.randn(49152, 576) * 0.02).to(device)
    auto = compute_dtype("auto", device)
    auto_name = str(auto).removeprefix("torch.")
    variants = [Variant("dense fp32", dense_attend, torch.float32, True, taught_rows_only=False),
                Variant("eaglet fp32", FUSED, torch.float32, False),
                Variant(f"eaglet auto ({auto_name})", FUSED, auto, False)]
    if args.compile:
        variants.append(Variant(f"eaglet auto ({auto_name}) compiled", FUSED, auto, False, compiled=True))
    print(f"{describe(device)}; batch 1, L={args.ttt_length}, {args.rounds} alternating rounds")
    for vocab in args.draft_vocab:
        reference = reference_draft(vocab)
        t2d = reference.t2d
        contenders = [contender(variant, reference, device) for variant in variants]
        teachers = {variant.dtype: Teacher(lm_head, t2d.to(device), variant.dtype) for variant in variants}
        for length in args.lengths:
            for entry in contenders:
                if entry.variant.compiled:
                    started = time.perf_counter()
                    step_seconds(entry, teachers[entry.variant.dtype], length, args.ttt_length, device, repeats=3)
                    print(f"Vd={vocab:>5} T={length:>5} {entry.variant.name}: warm-up of 3 steps (compilation "
                          f"included) {time.perf_counter() - started:.1f} s")
            rates: dict[str, list[float]] = {variant.name: [] for variant in variants}
            for _ in range(args.rounds):
                for entry in contenders:
                    seconds = step_seconds(entry, teachers[entry.variant.dtype], length, args.ttt_length, device)
                    rates[entry.variant.name].append(length / seconds)
            baseline = rates[variants[0].name]
            for variant in variants:
                ratios = [rate / base for rate, base in zip(rates[variant.name], baseline)]
                print(f"Vd={vocab:>5} T={length:>5} {variant.name:>31}: {statistics.median(rates[variant.name]):8.1f} "
                      f"tok/s, x{median_and_range(ratios, 2)} the dense fp32 baseline")
            if args.compile:
                eager, compiled = rates[variants[2].name], rates[variants[3].name]
                ratios = [fast / slow for fast, slow in zip(compiled, eager)]
                print(f"Vd={vocab:>5} T={length:>5} compiled / eager ({auto_name}): x{median_and_range(ratios, 3)}")


if __name__ == "__main__":
    main()
