"""One TTT training step, eaglet's against SpecForge 0.2's own trainer (OnlineEagle3Model), same shapes, same run.

    benchmarks/anchor_parity_env.sh     # once: .venv-anchors, the released specforge 0.2.0 wheel on eaglet's torch
    .venv-anchors/bin/python benchmarks/ttt_vs_specforge.py [--length 1024] [--draft-vocab 8192] [--ttt-length 7] \
        [--rounds 3] [--specforge fp32:sdpa fp32:sdpa:compact bf16:sdpa]

Why: benchmarks/ttt_throughput.py compares eaglet's step with a dense fp32 baseline written to behave like
SpecForge's trainer; this script runs the trainer itself, so the ratio the issue tracker asks for (eaglet's step
against SpecForge's at fp32) is measured rather than inferred from a proxy.

SpecForge's step is assembled from its public classes the way its offline EAGLE3 run assembles it
(specforge.algorithms.model_providers): the draft `LlamaForCausalLMEagle3` built by `AutoDraftModel.from_config`
with the embedding frozen, `OnlineEagle3Model` around it, the frozen `TargetHead` that re-runs the target's lm_head
over the stored final states, `Eagle3TrainStrategy.forward_loss` (ploss decay 0.8), `loss.backward()`, and its
`BF16Optimizer` (AdamW on fp32 master copies, clipping at 0.5, warm-up/cosine schedule). Each `--specforge` entry
is `dtype:attention_backend[:compact]`: the dtype its config's `torch_dtype` casts the draft and head to (fp32 is
the issue's baseline; bf16 is SpecForge's default), its attention backend (`sdpa`; SpecForge's default,
`flex_attention`, has no backward on a CPU in torch 2.13) and, with `compact`, its chunked teacher
(`training.compact_teacher`). One part is substituted, because the shipped one cannot run on a CPU: SpecForge's EAGLE3
loss (`LogSoftmaxLoss`) is a Triton kernel that needs a GPU, so its own reference implementation of the same loss
(`specforge.core.loss._compute_loss`, which it compiles with torch.compile) is called in its place
(`use_specforge_reference_loss`).

eaglet's step is benchmarks/ttt_throughput.py's (the trainer's collate, teacher, fused TTT attention, clipping and
AdamW), in fp32 and in the precision `training.precision: auto` picks on this host; the dense fp32 proxy runs too,
so the proxy's relation to the real trainer is on the same page.

Both see the SmolLM2 draft's shapes (hidden 576, 9/3 heads, vocab 49,152), batch 1, a sequence whose first 37 % is
prompt, fresh random inputs every step. Every contender runs two warm-up steps first (SpecForge compiles its teacher
and its loss with torch.compile; the compile time is printed apart), then rounds alternate the contenders and
time the second of two steps each. Printed: each contender's median tokens/s [min-max] and, per round, the ratio of
each eaglet variant (and the proxy) to each SpecForge setup, and of SpecForge's bf16 to its fp32, beside the host's
CPU flags.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Callable

import torch

# SpecForge's draft package warns at import that flash_attn is absent; only CPU backends run here.
warnings.filterwarnings("ignore", message="flash_attn is not found")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # eaglet is not installed in the anchor environment: import it from the repository
    sys.path.insert(0, str(REPO))

from rounds import median_and_range  # noqa: E402
from ttt_throughput import (FUSED, MAX_GRAD_NORM, PROMPT_SHARE, SMOLLM2, Variant, contender,  # noqa: E402
                            dense_attend, describe, draft_vocabulary, reference_draft, step_seconds)

from models.teacher import Teacher  # noqa: E402
from tasks.common.devices import compute_dtype  # noqa: E402

CPU = torch.device("cpu")
PLOSS_DECAY = 0.8  # SpecForge's Eagle3TrainStrategy default
LEARNING_RATE = 1e-4  # SpecForge's training.learning_rate default
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class SpecForgeSetup:
    """One SpecForge configuration: `dtype:attention_backend[:compact]`."""

    dtype_name: str
    attention_backend: str
    compact_teacher: bool

    @staticmethod
    def parse(text: str) -> "SpecForgeSetup":
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[0] not in DTYPES or (len(parts) == 3 and parts[2] != "compact"):
            raise argparse.ArgumentTypeError(f"--specforge {text!r}: expected dtype:backend[:compact], dtype one of "
                                             f"{sorted(DTYPES)}")
        return SpecForgeSetup(parts[0], parts[1], len(parts) == 3)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def name(self) -> str:
        teacher = ", compact teacher" if self.compact_teacher else ""
        return f"SpecForge {self.dtype_name} {self.attention_backend}{teacher}"


class ReferenceLoss:
    """SpecForge's reference loss behind the `LogSoftmaxLoss.apply` call its EAGLE3 model makes."""

    @staticmethod
    def apply(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
        from specforge.core.loss import _compute_loss

        return _compute_loss(logits, target_p, position_mask)


def use_specforge_reference_loss() -> None:
    """Route SpecForge's EAGLE3 loss to its reference implementation: its Triton kernel cannot launch on a CPU."""
    import specforge.algorithms.eagle3.model as eagle3_model

    eagle3_model.LogSoftmaxLoss = ReferenceLoss


def llama_fields() -> dict:
    """SMOLLM2's fields that a transformers LlamaConfig takes (the aux layer ids are eaglet's own)."""
    return {key: value for key, value in SMOLLM2.items() if key != "aux_layer_ids"}


def write_target_config(directory: Path) -> None:
    """The SmolLM2-shaped target's config.json, which SpecForge's TargetHead reads (its lm_head is copied in)."""
    from transformers import LlamaConfig

    LlamaConfig(**llama_fields(), num_hidden_layers=30).save_pretrained(directory)


class SpecForgeTrainer:
    """SpecForge's offline EAGLE3 training step for one setup: strategy forward, backward, its optimizer.
    `target_dir` holds the target's config.json (write_target_config)."""

    def __init__(self, setup: SpecForgeSetup, draft_vocab: int, ttt_length: int, lm_head: torch.Tensor,
                 target_dir: Path) -> None:
        from transformers import LlamaConfig

        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.auto import AutoDraftModel
        from specforge.modeling.target.target_head import TargetHead
        from specforge.optimizer import BF16Optimizer
        from specforge.training.strategies.base import Eagle3TrainStrategy

        self.setup = setup
        config = LlamaConfig(**llama_fields(), num_hidden_layers=1, draft_vocab_size=draft_vocab,
                             architectures=["LlamaForCausalLMEagle3"])
        draft = AutoDraftModel.from_config(config, attention_backend=setup.attention_backend, torch_dtype=setup.dtype)
        draft.t2d.copy_(draft_vocabulary(draft_vocab))
        draft.d2t.zero_()  # the draft vocabulary is the target's first ids: every offset is 0
        draft.freeze_embedding()
        model = OnlineEagle3Model(draft_model=draft, length=ttt_length,
                                  attention_backend=setup.attention_backend).to(dtype=setup.dtype)
        head = TargetHead(str(target_dir))
        with torch.no_grad():
            head.fc.weight.copy_(lm_head)
        head.freeze_weights()
        head = head.eval().to(dtype=setup.dtype)
        self.strategy = Eagle3TrainStrategy(model, target_head=head, ploss_decay=PLOSS_DECAY,
                                            compact_teacher=setup.compact_teacher)
        self.optimizer = BF16Optimizer(model, lr=LEARNING_RATE, max_grad_norm=MAX_GRAD_NORM, total_steps=10_000)

    def step_seconds(self, length: int, repeats: int = 2) -> float:
        """Seconds of the last of `repeats` steps, each on fresh random inputs of `length` tokens."""
        from specforge.runtime.contracts import TrainBatch

        hidden = SMOLLM2["hidden_size"]
        mask = torch.ones(1, length, dtype=torch.long)
        mask[:, : int(length * PROMPT_SHARE)] = 0
        timings = []
        for index in range(repeats):
            started = time.perf_counter()
            tensors = {
                "input_ids": torch.randint(0, SMOLLM2["vocab_size"], (1, length)),
                "attention_mask": torch.ones(1, length, dtype=torch.long),
                "loss_mask": mask.clone(),
                "hidden_state": torch.randn(1, length, 3 * hidden).to(self.setup.dtype),
                "target": torch.randn(1, length, hidden).to(self.setup.dtype),
            }
            batch = TrainBatch(sample_ids=[str(index)], strategy="eagle3", tensors=tensors,
                               metadata={"target_repr": "hidden_state"})
            loss = self.strategy.forward_loss(batch).loss
            loss.backward()
            self.optimizer.step()
            timings.append(time.perf_counter() - started)
        return timings[-1]


@dataclass
class Runner:
    """A named contender and how to time one of its steps (seconds). `specforge`: one of SpecForge's setups, the
    baselines; `fp32`: runs in fp32 (SpecForge's fp32 setups are the issue's baseline)."""

    name: str
    seconds: Callable[[], float]
    specforge: bool
    fp32: bool


def compared(baseline: Runner, runners: list[Runner]) -> list[Runner]:
    """What is printed as a ratio to a SpecForge setup: everything not SpecForge's, and against an fp32 setup also
    SpecForge's other precisions (its own gain from bf16)."""
    return [runner for runner in runners
            if not runner.specforge or (baseline.fp32 and not runner.fp32)]


def eaglet_runners(draft_vocab: int, length: int, ttt_length: int, lm_head: torch.Tensor) -> list[Runner]:
    """The dense fp32 proxy, eaglet fp32 and eaglet in the precision `auto` picks here."""
    auto = compute_dtype("auto", CPU)
    variants = [Variant("dense fp32 proxy", dense_attend, torch.float32, True, taught_rows_only=False),
                Variant("eaglet fp32", FUSED, torch.float32, False),
                Variant(f"eaglet auto ({str(auto).removeprefix('torch.')})", FUSED, auto, False)]
    reference = reference_draft(draft_vocab)
    runners = []
    for variant in variants:
        entry = contender(variant, reference, CPU)
        teacher = Teacher(lm_head, reference.t2d, variant.dtype)
        runners.append(Runner(variant.name, lambda entry=entry, teacher=teacher: step_seconds(
            entry, teacher, length, ttt_length, CPU), specforge=False, fp32=variant.dtype == torch.float32))
    return runners


def specforge_runners(setups: list[SpecForgeSetup], draft_vocab: int, length: int, ttt_length: int,
                      lm_head: torch.Tensor, target_dir: Path) -> list[Runner]:
    write_target_config(target_dir)
    runners = []
    for setup in setups:
        trainer = SpecForgeTrainer(setup, draft_vocab, ttt_length, lm_head, target_dir)
        runners.append(Runner(setup.name, lambda trainer=trainer: trainer.step_seconds(length),
                              specforge=True, fp32=setup.dtype == torch.float32))
    return runners


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--specforge", type=SpecForgeSetup.parse, nargs="+",
                        default=[SpecForgeSetup.parse(text) for text in
                                 ("fp32:sdpa", "fp32:sdpa:compact", "bf16:sdpa")])
    args = parser.parse_args()
    torch.manual_seed(0)
    use_specforge_reference_loss()

    lm_head = torch.randn(SMOLLM2["vocab_size"], SMOLLM2["hidden_size"]) * 0.02
    print(f"{describe(CPU)}; specforge {version('specforge')}; "
          f"batch 1, T={args.length}, Vd={args.draft_vocab}, TTT {args.ttt_length}, {args.rounds} alternating rounds")
    with tempfile.TemporaryDirectory() as target_dir:
        runners = specforge_runners(args.specforge, args.draft_vocab, args.length, args.ttt_length, lm_head,
                                    Path(target_dir))
        runners += eaglet_runners(args.draft_vocab, args.length, args.ttt_length, lm_head)
        for runner in runners:
            started = time.perf_counter()
            runner.seconds()
            seconds = time.perf_counter() - started
            print(f"{runner.name:>42}: warm-up of 2 steps (compilation included) {seconds:.1f} s", flush=True)
        rates: dict[str, list[float]] = {runner.name: [] for runner in runners}
        for round_index in range(args.rounds):
            for runner in runners:
                rates[runner.name].append(args.length / runner.seconds())
            latest = ", ".join(f"{name} {values[-1]:.0f}" for name, values in rates.items())
            print(f"round {round_index + 1}: {latest}", flush=True)
    print()
    for runner in runners:
        print(f"{runner.name:>42}: {median_and_range(rates[runner.name], 0)} tok/s")
    for baseline in (runner for runner in runners if runner.specforge):
        for candidate in compared(baseline, runners):
            ratios = [fast / slow for fast, slow in zip(rates[candidate.name], rates[baseline.name])]
            print(f"{candidate.name:>42} / {baseline.name}: x{median_and_range(ratios, 2)}")


if __name__ == "__main__":
    main()
