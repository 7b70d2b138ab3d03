"""Trainer checkpoints that make a resumed run continue exactly as if it had never stopped.

`checkpoints/step-00000N/` holds the draft weights, the optimizer and scheduler state, every rank's RNG
states (CPU and, on a GPU host, CUDA), the data cursor, the run config, and the `math` fields (everything that
changes the numbers). A checkpoint is written under a temp name and renamed; the last `keep_last` are kept, plus
the best by eval `simulated_accept_len`. Resuming with a different `math` field is refused, naming the field;
nothing is deleted for it (tasks/training/previous_run.py sets an old run aside only when asked to start over).

`training.resume_from`: `auto` (default) continues the newest checkpoint when there is one and the same code
wrote it, `none` starts over, a path continues that checkpoint whatever code wrote it. A checkpoint records the
train stage's code fingerprint (`training_code_fingerprint`): when the code changed, DVC and the flow run the stage
again, and continuing the old run under `auto` would hand back the weights the old code trained (for a finished
run, the very same export), so `auto` starts over instead, setting the old run aside.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy
import torch
from safetensors.torch import load_file, save_file

from contract.config import RESUME_AUTO, RESUME_NONE, RunConfig
from contract.hashing import hash_files
from tasks.common.artifacts import atomic_directory, write_json
from tasks.training.batch_plan import Cursor

BEST_LINK = "best.json"


class ResumeRefused(ValueError):
    """A checkpoint trained under different math than the run that wants to continue it."""


def shuffle_math(shuffle_groups: int, buffer_shards: int) -> str:
    """The epoch order as it bears on the weights: one group is the plain shuffle whatever the buffer size."""
    return "plain" if shuffle_groups <= 1 else f"{buffer_shards} shards per group"


def math_fields(cfg: RunConfig, world_size: int, features_fingerprint: str, compute_dtype: str,
                shuffle_groups: int = 1) -> dict[str, Any]:
    """Settings that change the weights a run produces (intervals and retention do not)."""
    training = cfg.training
    fields: dict[str, Any] = {
        "training.mode": training.mode, "training.ttt_length": training.ttt_length,
        "training.learning_rate": training.learning_rate, "training.weight_decay": training.weight_decay,
        "training.warmup_ratio": training.warmup_ratio, "training.max_grad_norm": training.max_grad_norm,
        "training.hidden_noise_std": training.hidden_noise_std, "training.dropout": training.dropout,
        "training.freeze_lm_head": training.freeze_lm_head,
        "training.epochs": training.epochs, "training.max_steps": training.max_steps,
        "training.tokens_per_step": training.tokens_per_step, "training.grad_accumulation": training.grad_accumulation,
        "training.shuffle": shuffle_math(shuffle_groups, training.shuffle_buffer_shards),
        "training.precision": compute_dtype,
        "capture.aux_layer_ids": cfg.capture.aux_layer_ids, "capture.draft_vocab_size": cfg.capture.draft_vocab_size,
        "runtime.seed": cfg.runtime.seed, "deployment.trainer.nproc_per_node": world_size,
        "features.fingerprint": features_fingerprint,
    }
    # absent at their defaults, so checkpoints written before these settings existed still match
    if training.length_window > 1:
        fields["training.length_window"] = training.length_window
    if cfg.draft.method != "eagle3":
        fields["draft.method"] = cfg.draft.method
    if cfg.draft.mask_token_id is not None:
        fields["draft.mask_token_id"] = cfg.draft.mask_token_id
    return fields


@dataclass
class TrainerState:
    step: int
    cursor: Cursor
    math: dict[str, Any]
    scheduler: dict[str, Any]
    eval_metrics: dict[str, float]
    best_simulated_accept_len: Optional[float] = None
    code: str = ""  # training_code_fingerprint() of the code that wrote it ("" before it was recorded)


def rng_state() -> dict[str, Any]:
    """Every generator a training step draws from (noise, dropout, shuffles): Python's, NumPy's, torch's CPU
    generator and, where CUDA is available, each visible GPU's (empty on a CPU host). Plain lists, written as JSON."""
    numpy_state = numpy.random.get_state()
    cuda = [state.tolist() for state in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
    return {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
        "torch": torch.get_rng_state().tolist(),
        "cuda": cuda,
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what rng_state() saved. The CUDA generators are restored for the GPUs visible now (a checkpoint
    written before they were saved, or on a CPU host, has none; a CPU host draws nothing from them)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), position, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    saved_cuda = state.get("cuda", [])
    if saved_cuda and torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if len(saved_cuda) != visible:
            raise ResumeRefused(f"the checkpoint holds the CUDA generators of {len(saved_cuda)} GPUs, this rank sees "
                                f"{visible}: resume with the same visible GPUs, or the noise would differ")
        torch.cuda.set_rng_state_all([torch.tensor(values, dtype=torch.uint8) for values in saved_cuda])


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def save_checkpoint(root: Path, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any], state: TrainerState,
                    rank_rng: list[dict[str, Any]], config_yaml: str) -> Path:
    """Write one checkpoint atomically (rank 0 calls this with the full weights, the full optimizer state
    keyed by parameter name, and every rank's RNG state)."""
    target = checkpoint_dir(root, state.step)
    with atomic_directory(target) as staging:
        save_file({name: value.detach().cpu().contiguous() for name, value in weights.items()},
                  str(staging / "draft.safetensors"))
        torch.save(optimizer_state, staging / "optimizer.pt")
        payload = asdict(state)
        (staging / "trainer_state.json").write_text(json.dumps(payload, indent=2) + "\n")
        for rank, rng in enumerate(rank_rng):
            (staging / f"rng-rank{rank}.json").write_text(json.dumps(rng))
        (staging / "config.yaml").write_text(config_yaml)
    return target


@dataclass
class LoadedCheckpoint:
    state: TrainerState
    weights: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]


def load_checkpoint(directory: Path, rank: int) -> LoadedCheckpoint:
    """Read weights, optimizer state and trainer state, and restore this rank's RNG (safe loads only)."""
    weights = load_file(str(directory / "draft.safetensors"))
    optimizer_state = torch.load(directory / "optimizer.pt", weights_only=True)
    payload = json.loads((directory / "trainer_state.json").read_text())
    restore_rng(json.loads((directory / f"rng-rank{rank}.json").read_text()))
    payload["cursor"] = Cursor(**payload["cursor"])
    return LoadedCheckpoint(TrainerState(**payload), weights, optimizer_state)


def differing_math(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """One line per math field whose value differs between a checkpoint and this run; a field the checkpoint
    does not record differs too (what it was trained under is unknown)."""
    return [f"{name}: checkpoint {repr(saved[name]) if name in saved else 'not recorded'}, run {value!r}"
            for name, value in wanted.items() if name not in saved or saved[name] != value]


def check_resumable(saved: dict[str, Any], wanted: dict[str, Any], directory: Path) -> None:
    differing = differing_math(saved, wanted)
    if differing:
        raise ResumeRefused(
            f"cannot resume from {directory}: it was trained with other settings:\n  - " + "\n  - ".join(differing)
            + "\nIts checkpoints are kept. To train with the new settings, either set training.resume_from=none (the "
            "old run's checkpoints, step log and exports move to checkpoints.superseded-<time>/ first) or give the "
            "run its own output_dir (a new run_id).")


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoints under `root`, oldest first (a temp directory of a killed save is not one)."""
    return sorted(path for path in root.glob("step-*") if (path / "trainer_state.json").is_file())


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under `root` (None when there is none)."""
    candidates = complete_checkpoints(root)
    return candidates[-1] if candidates else None


def training_code_fingerprint() -> str:
    """The content hash of the code the train stage runs (the files dvc.yaml lists as its code deps)."""
    from tasks.common.stage_code import REPO_ROOT, stage_code_deps

    return hash_files((REPO_ROOT / path for path in stage_code_deps("train")), root=REPO_ROOT)


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues (None: start fresh), and why an `auto` run starts fresh despite one."""

    checkpoint: Optional[Path]
    other_code: Optional[Path] = None  # the newest checkpoint, written by other code (auto starts over)


def resume_point(root: Path, resume_from: str, wanted_math: dict[str, Any], code: str) -> ResumePoint:
    """The checkpoint this run continues; refuses one trained under other math. Under `auto`, a checkpoint that
    other code wrote is not continued (the stage runs again because its code changed)."""
    if resume_from == RESUME_NONE:
        return ResumePoint(None)
    if resume_from == RESUME_AUTO:
        checkpoint = latest_checkpoint(root)
    else:
        checkpoint = Path(resume_from)
        if not (checkpoint / "trainer_state.json").is_file():
            raise FileNotFoundError(f"training.resume_from '{resume_from}' is not a trainer checkpoint")
    if checkpoint is None:
        return ResumePoint(None)
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    if resume_from == RESUME_AUTO and saved.get("code", "") != code:
        return ResumePoint(None, other_code=checkpoint)
    check_resumable(saved["math"], wanted_math, checkpoint)
    return ResumePoint(checkpoint)


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints and the best one."""
    best = json.loads((root / BEST_LINK).read_text())["checkpoint"] if (root / BEST_LINK).is_file() else None
    for path in complete_checkpoints(root)[:-keep_last]:
        if path.name != best:
            shutil.rmtree(path)


def record_best(root: Path, directory: Path, value: float) -> None:
    """best.json names the best checkpoint; written atomically (pruning reads it to know what to keep)."""
    write_json(root / BEST_LINK, {"checkpoint": directory.name, "simulated_accept_len": value})
