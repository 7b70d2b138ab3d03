"""train stage: the EAGLE3 draft trained with the training-time test on captured features (offline).

    one process:  eaglet stage train --config params.yaml
    two ranks:    eaglet stage train --config params.yaml deployment.trainer.nproc_per_node=2
                  (eaglet itself runs: python -m torch.distributed.run --standalone --nproc_per_node 2
                   -m tasks.train --config <output_dir>/train/launch.yaml)
    resume:       eaglet stage train --config params.yaml training.resume_from=latest

Data parallel with DistributedDataParallel (gloo on CPU, nccl on GPU): every rank plans the same global
batches and takes its share, so N ranks compute the same steps as one. Only the draft, the target's
lm_head, embedding and final norm are in memory. Writes `checkpoints/step-N/`, `train/steps.jsonl`,
`train/summary.json`, `train/accuracy_by_depth.png` and the engine exports `draft/sglang`, `draft/vllm`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from contract.config import RunConfig
from contract.config_loading import config_as_yaml, load_config
from models.eagle3 import Eagle3Config, Eagle3Draft
from models.target_heads import TargetHeads, load_target_heads
from models.ttt import TTTBatch, TTTOutput, simulated_accept_length, ttt_forward
from models.vocab_mapping import load_vocab_mapping
from tasks.artifacts import read_json, write_json
from tasks.feature_batches import collate
from tasks.features import FeatureSet, check_manifest
from tasks.train_checkpoint import (TrainerState, check_resumable, find_checkpoint, load_checkpoint, math_fields,
                                    prune_checkpoints, record_best, rng_state, save_checkpoint)
from tasks.train_data import Cursor, epoch_batches, rank_share
from tasks.train_outputs import ENGINES, export, plot_accuracy, training_tracker

class TrainingDiverged(RuntimeError):
    """The loss stopped being a number; the message names the step and the records of the batch."""


class TrainingFailed(RuntimeError):
    """A distributed training run exited with an error; the message holds the end of its log."""


@dataclass
class TrainResult:
    summary_path: Path
    values: dict[str, Any]

    def summary(self) -> dict[str, float]:
        """The numeric part of train/summary.json (MLflow metrics)."""
        return {key: float(value) for key, value in self.values.items() if isinstance(value, (int, float))}

    def reports(self) -> list[Path]:
        plot = self.summary_path.parent / "accuracy_by_depth.png"
        return [self.summary_path] + ([plot] if plot.is_file() else [])


class TTTStep(nn.Module):
    """The draft's training-time test as one module call, so DistributedDataParallel can wrap it."""

    def __init__(self, draft: Eagle3Draft, steps: int) -> None:
        super().__init__()
        self.draft = draft
        self.steps = steps

    def forward(self, batch: TTTBatch, normaliser: int) -> tuple[torch.Tensor, TTTOutput]:
        output = ttt_forward(self.draft, batch, self.steps, normaliser=normaliser)
        return output.loss, output


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def run(cfg: RunConfig) -> TrainResult:
    """Train (in this process, or under torchrun when more than one rank is configured)."""
    if cfg.training.mode == "online":
        raise ValueError("training.mode 'online' is not available yet: run the capture stage and train offline")
    if cfg.training.grad_accumulation != 1:
        raise ValueError("training.grad_accumulation > 1 is not available yet: raise training.tokens_per_step instead")
    world = cfg.deployment.trainer.nproc_per_node
    if world > 1 and "RANK" not in os.environ:
        return launch_ranks(cfg, world)
    return train(cfg)


def launch_ranks(cfg: RunConfig, world: int) -> TrainResult:
    """Run `world` ranks with torchrun on this node; their log goes to train/torchrun.log."""
    train_dir = cfg.output_path / "train"
    train_dir.mkdir(parents=True, exist_ok=True)
    config_path = train_dir / "launch.yaml"
    resolved = cfg.model_copy(update={"output_dir": str(cfg.output_path.resolve())})
    config_path.write_text(config_as_yaml(resolved))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "tasks.train", "--config", str(config_path)]
    log_path = train_dir / "torchrun.log"
    with open(log_path, "w", encoding="utf-8") as log:
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **parent_run_env()})
    if completed.returncode != 0:
        tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-40:])
        raise TrainingFailed(f"{' '.join(command)} exited with {completed.returncode}; end of {log_path}:\n{tail}")
    summary_path = train_dir / "summary.json"
    return TrainResult(summary_path, read_json(summary_path))


def parent_run_env() -> dict[str, str]:
    """Pass the pipeline's active MLflow run down so the ranks' run nests under it."""
    if "mlflow" not in sys.modules:
        return {}
    import mlflow

    active = mlflow.active_run()
    return {"EAGLET_PARENT_RUN_ID": active.info.run_id} if active else {}


def setup_distributed() -> Distributed:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Distributed()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    return Distributed(rank=dist.get_rank(), world_size=world)


def build_draft(cfg: RunConfig, heads: TargetHeads, manifest: dict[str, Any]) -> Eagle3Draft:
    from transformers import AutoConfig

    vocab = load_vocab_mapping(cfg.output_path / "vocab" / "vocab_mapping.safetensors")
    target_config = AutoConfig.from_pretrained(cfg.output_path / "target", trust_remote_code=cfg.model.trust_remote_code)
    torch.manual_seed(cfg.runtime.seed)
    draft = Eagle3Draft(Eagle3Config.from_target(target_config, vocab.draft_vocab_size, manifest["aux_layer_ids"]))
    draft.set_vocab_mapping(vocab.d2t, vocab.t2d)
    draft.attach_embedding(heads.embedding)
    draft.initialise_from_target(heads.lm_head, heads.final_norm)
    return draft


def schedule(total_steps: int, warmup_ratio: float):
    """Linear warmup, then cosine decay to zero."""
    warmup = max(1, int(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


@dataclass
class Loop:
    """Everything the step loop touches."""

    cfg: RunConfig
    env: Distributed
    draft: Eagle3Draft
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_set: FeatureSet
    eval_set: Optional[FeatureSet]
    heads: TargetHeads
    lengths: list[int]
    record_ids: list[str]
    total_steps: int
    math: dict[str, Any]
    state: TrainerState
    tracker: Any = None
    history: list[dict[str, float]] = field(default_factory=list)


def train(cfg: RunConfig) -> TrainResult:
    env = setup_distributed()
    try:
        return train_ranks(cfg, env)
    finally:
        if env.world_size > 1:
            dist.destroy_process_group()


def train_ranks(cfg: RunConfig, env: Distributed) -> TrainResult:
    features_dir = cfg.output_path / "features"
    target_info = read_json(cfg.output_path / "target.json")
    train_set = FeatureSet(features_dir, "train")
    check_manifest(train_set.manifest, cfg, target_info)
    eval_set = FeatureSet(features_dir, "eval") if train_set.manifest["splits"].get("eval", {}).get("records") else None
    heads = load_target_heads(cfg.output_path / "target")
    draft = build_draft(cfg, heads, train_set.manifest)
    module: nn.Module = TTTStep(draft, cfg.training.ttt_length)
    if env.world_size > 1:
        module = nn.parallel.DistributedDataParallel(module)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.training.learning_rate, weight_decay=cfg.training.weight_decay)
    lengths, record_ids = [], []
    for record in train_set:
        lengths.append(len(record["input_ids"]))
        record_ids.append(record["id"])
    plans = [epoch_batches(lengths, cfg.training.tokens_per_step, cfg.runtime.seed, epoch)
             for epoch in range(cfg.training.epochs)]
    total_steps = min(cfg.training.max_steps or 10**12, sum(len(plan) for plan in plans))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(total_steps, cfg.training.warmup_ratio))
    math_now = math_fields(cfg, env.world_size, train_set.manifest.get("fingerprint", ""))
    state = TrainerState(step=0, cursor=Cursor(), math=math_now, scheduler={}, eval_metrics={})
    checkpoint = find_checkpoint(cfg.output_path / "checkpoints", cfg.training.resume_from)
    if checkpoint is None:
        start_fresh(cfg, env)
    else:
        check_resumable(read_json(checkpoint / "trainer_state.json")["math"], math_now, checkpoint)
        state = load_checkpoint(checkpoint, draft, optimizer, env.rank)
        scheduler.load_state_dict(state.scheduler)
    loop = Loop(cfg, env, draft, module, optimizer, scheduler, train_set, eval_set, heads, lengths, record_ids,
                total_steps, math_now, state)
    with training_tracker(cfg, env) as tracker:
        loop.tracker = tracker
        before = evaluate(loop) if env.is_main and state.step == 0 else {}
        run_steps(loop, plans)
        return finish(loop, before)


def start_fresh(cfg: RunConfig, env: Distributed) -> None:
    """A run that does not resume replaces the previous run's checkpoints, step log and exports."""
    if env.is_main:
        for name in ("checkpoints", "train/steps.jsonl", "train/summary.json", "draft"):
            path = cfg.output_path / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    env.barrier()


def run_steps(loop: Loop, plans: list[list[list[int]]]) -> None:
    """The step loop, from the state's cursor; stops at total_steps or after training.halt_after steps."""
    from tasks.progress import progress_bar

    cfg, state = loop.cfg, loop.state
    halt_at = state.step + cfg.training.halt_after if cfg.training.halt_after else None
    with progress_bar("train", loop.total_steps) as bar:
        bar.update(bar.task_ids[0], completed=state.step)
        for epoch in range(state.cursor.epoch, len(plans)):
            start = state.cursor.batch if epoch == state.cursor.epoch else 0
            for batch_index in range(start, len(plans[epoch])):
                if state.step >= loop.total_steps:
                    return
                if halt_at is not None and state.step >= halt_at:
                    save(loop)  # a preemption notice: checkpoint here, resume continues from this step
                    return
                metrics = train_step(loop, plans[epoch][batch_index])
                state.step += 1
                state.cursor = Cursor(epoch, batch_index + 1) if batch_index + 1 < len(plans[epoch]) else Cursor(epoch + 1, 0)
                after_step(loop, metrics)
                bar.update(bar.task_ids[0], completed=state.step,
                           description=f"train loss {metrics['loss']:.3f} {metrics['tokens_per_second']:.0f} tok/s")


def train_step(loop: Loop, global_batch: list[int]) -> dict[str, float]:
    env = loop.env
    started = time.perf_counter()
    mine = rank_share(global_batch, env.rank, env.world_size)
    idle = not mine  # more ranks than records in this batch: a zero-weight pass keeps the collectives in step
    records = [loop.train_set[index] for index in (mine or global_batch[:1])]
    batch = collate(records, loop.heads.lm_head, loop.draft.t2d)
    if idle:
        batch.loss_mask.zero_()
        records = []
    waited = time.perf_counter() - started
    normaliser = sum(loop.lengths[index] for index in global_batch)
    loss, output = loop.module(batch, normaliser)
    (loss * env.world_size).backward()
    finite = env.all_sum([0.0 if torch.isfinite(loss) else 1.0])[0] == 0.0
    if not finite:
        ids = [loop.record_ids[index] for index in global_batch]
        raise TrainingDiverged(f"loss is not finite at step {loop.state.step + 1} (records {', '.join(ids)})")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(loop.draft.parameters(), loop.cfg.training.max_grad_norm))
    loop.optimizer.step()
    loop.scheduler.step()
    loop.optimizer.zero_grad(set_to_none=True)
    counts = [output.supervised[step] for step in range(len(output.acc))]
    correct = [output.acc[step] * counts[step] for step in range(len(output.acc))]
    reduced = env.all_sum([float(loss.detach()), *[float(p.detach()) for p in output.ploss], *correct, *counts,
                           float(sum(len(r["input_ids"]) for r in records)), waited])
    steps = len(output.acc)
    elapsed = time.perf_counter() - started
    metrics = {"loss": reduced[0], "lr": loop.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
               "tokens_per_second": reduced[1 + 3 * steps] / elapsed,
               "data_wait_share": reduced[2 + 3 * steps] / env.world_size / elapsed}
    for step in range(steps):
        metrics[f"ploss_{step}"] = reduced[1 + step]
        total = reduced[1 + 2 * steps + step]
        metrics[f"acc_{step}"] = reduced[1 + steps + step] / total if total else 0.0
    return metrics


def after_step(loop: Loop, metrics: dict[str, float]) -> None:
    """Log, evaluate and checkpoint on their intervals (and at the end)."""
    cfg, env, state = loop.cfg, loop.env, loop.state
    last = state.step >= loop.total_steps
    if env.is_main:
        record = {"step": state.step, **metrics}
        loop.history.append(record)
        steps_path = cfg.output_path / "train" / "steps.jsonl"
        steps_path.parent.mkdir(parents=True, exist_ok=True)
        with open(steps_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        if loop.tracker is not None:
            loop.tracker.log_metrics({f"train.{key}": value for key, value in metrics.items()}, step=state.step)
    if env.is_main and (state.step % cfg.training.eval_interval == 0 or last):
        state.eval_metrics = evaluate(loop)
        if loop.tracker is not None and state.eval_metrics:
            loop.tracker.log_metrics({f"eval.{key}": value for key, value in state.eval_metrics.items()}, step=state.step)
    if state.step % cfg.training.save_interval == 0 or last:
        save(loop)


def save(loop: Loop) -> None:
    env, state = loop.env, loop.state
    rngs = env.gather(rng_state())
    if env.is_main:
        root = loop.cfg.output_path / "checkpoints"
        state.scheduler = loop.scheduler.state_dict()
        directory = save_checkpoint(root, loop.draft, loop.optimizer, state, rngs, config_as_yaml(loop.cfg))
        score = state.eval_metrics.get("simulated_accept_len")
        if score is not None and (state.best_simulated_accept_len is None or score > state.best_simulated_accept_len):
            state.best_simulated_accept_len = score
            record_best(root, directory, score)
        prune_checkpoints(root, loop.cfg.training.keep_last)
    env.barrier()


def evaluate(loop: Loop) -> dict[str, float]:
    """Eval acceptance metrics of the draft being trained (rank 0)."""
    if loop.eval_set is None:
        return {}
    return evaluate_features(loop.draft, loop.eval_set, loop.heads.lm_head, loop.cfg.training.ttt_length)


def evaluate_features(draft: Eagle3Draft, features: FeatureSet, lm_head: torch.Tensor, steps: int) -> dict[str, float]:
    """acc_k, expected acceptance and ploss per depth over every record, weighted by supervised positions,
    and the simulated accept length of a chain of `steps`."""
    correct, counts, accepted, ploss = [0.0] * steps, [0.0] * steps, [0.0] * steps, [0.0] * steps
    with torch.no_grad():
        for record in features:
            output = ttt_forward(draft, collate([record], lm_head, draft.t2d), steps)
            for step in range(steps):
                counts[step] += output.supervised[step]
                correct[step] += output.acc[step] * output.supervised[step]
                accepted[step] += output.expected_accept[step] * output.supervised[step]
                ploss[step] += float(output.ploss[step])
    metrics: dict[str, float] = {}
    for step in range(steps):
        metrics[f"acc_{step}"] = correct[step] / counts[step] if counts[step] else 0.0
        metrics[f"expected_accept_{step}"] = accepted[step] / counts[step] if counts[step] else 0.0
        metrics[f"ploss_{step}"] = ploss[step] / len(features)
    metrics["simulated_accept_len"] = simulated_accept_length([metrics[f"acc_{step}"] for step in range(steps)])
    return metrics


def finish(loop: Loop, before: dict[str, float]) -> TrainResult:
    """Export the draft for each engine, plot accuracy by depth, write the summary (rank 0)."""
    cfg, env, state = loop.cfg, loop.env, loop.state
    summary_path = cfg.output_path / "train" / "summary.json"
    if env.is_main:
        complete = state.step >= loop.total_steps
        if complete:
            export(cfg, loop.draft, loop.train_set.manifest, state.step, env.world_size, state.eval_metrics)
        plot = plot_accuracy(state.eval_metrics, before, cfg.output_path / "train" / "accuracy_by_depth.png")
        summary = {"steps": state.step, "total_steps": loop.total_steps, "complete": complete, "world_size": env.world_size,
                   **{f"eval_{key}": value for key, value in state.eval_metrics.items()},
                   **{f"untrained_{key}": value for key, value in before.items() if key == "simulated_accept_len"}}
        if loop.history:
            summary["tokens_per_second"] = sum(h["tokens_per_second"] for h in loop.history) / len(loop.history)
            summary["data_wait_share"] = sum(h["data_wait_share"] for h in loop.history) / len(loop.history)
        write_json(summary_path, summary)
        if loop.tracker is not None:
            if plot is not None:
                loop.tracker.log_artifact(str(plot), "train")
            for engine in ENGINES:
                if (cfg.output_path / "draft" / engine).is_dir():
                    loop.tracker.log_artifacts(str(cfg.output_path / "draft" / engine), f"draft/{engine}")
    env.barrier()
    return TrainResult(summary_path, read_json(summary_path))


def main() -> None:
    """Entry point of each torchrun rank."""
    parser = argparse.ArgumentParser(description="eaglet training rank (started by `eaglet stage train`)")
    parser.add_argument("--config", required=True)
    arguments = parser.parse_args()
    train(load_config(arguments.config))


if __name__ == "__main__":
    main()
