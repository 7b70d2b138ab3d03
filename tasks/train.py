"""train stage: the EAGLE3 draft trained with the training-time test, on captured features (offline) or on
features the target computes in this process per batch (online).

    one process:  eaglet stage train --config params.yaml
    two ranks:    eaglet stage train --config params.yaml deployment.trainer.nproc_per_node=2
                  (eaglet itself runs: python -m torch.distributed.run --standalone --nproc_per_node 2
                   -m tasks.train --config <output_dir>/train/launch.yaml)
    two nodes:    eaglet stage train --config params.yaml deployment.trainer.nnodes=2
                      deployment.trainer.rdzv_endpoint=node0.example:29400      (on node 0; output_dir shared)
                  prints the torchrun line to run on node 1 (tasks/training/launch.py)
    resume:       the default (training.resume_from: auto) continues the newest checkpoint of a matching run;
                  training.resume_from=none starts over (the old run is set aside, never deleted)

    online:       eaglet stage train --config params.yaml training.mode=online
    FSDP2:        ... deployment.trainer.nproc_per_node=2 deployment.trainer.strategy=fsdp

Data parallel (tasks/training/parallel.py: DDP by default, FSDP2 as an option; gloo on CPU, nccl on GPU):
every rank plans the same global batches and takes its share, so N ranks compute the same steps as one.
An optimizer step accumulates `training.grad_accumulation` micro-batches, normalised as one batch.
Offline, only the draft and the target's lm_head, embedding and final norm are in memory; online, the
target too. fp32 on CPU; on GPU bf16 autocast over fp32 master weights (`training.precision`).
Writes `checkpoints/step-N/`, `train/steps.jsonl`, `train/summary.json`, `train/accuracy_by_depth.png`
and the engine exports `draft/sglang`, `draft/vllm`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from contract.checkpoint import ENGINES
from contract.config import RunConfig
from contract.config_loading import config_as_yaml, load_config
from models.draft_methods import MASKED_METHODS, DraftModel, draft_objective, method_config, new_draft
from models.eagle3 import Eagle3Config
from models.target_heads import TargetHeads, load_target_heads
from models.teacher import Teacher
from models.ttt import TTTBatch, TTTOutput, check_attention_backend, simulated_accept_length, step_loss
from models.ttt_compile import compile_draft_parts
from models.vocab_mapping import load_vocab_mapping
from tasks.common.artifacts import atomic_file, read_json, write_json
from tasks.common.devices import autocast, compute_dtype, resolve_device
from tasks.common.host_compute import host_compute
from tasks.common.target_info import load_tokenizer
from tasks.features.batches import SettledCache, collate
from tasks.features.engine_states import EngineStates, online_capture_engine
from tasks.features.shards import FeatureSet, check_manifest
from tasks.training.checkpoint import (TrainerState, load_checkpoint, math_fields, prune_checkpoints, record_best,
                                       resume_point, rng_state, save_checkpoint,
                                       training_code_fingerprint)
from tasks.training.previous_run import cut_step_log, replay_step_metrics, set_aside
from tasks.training.batch_plan import Cursor, epoch_batches, optimizer_steps, rank_share
from tasks.training.parallel import (Distributed, full_draft_weights, full_optimizer_state, gradient_sync,
                                     leave_process_group, load_full_state, parallelise, setup_distributed)
from tasks.training.outputs import export, plot_accuracy, training_tracker
from tasks.training.launch import launch_config_path, other_node_commands, torchrun_command
from tasks.training.mask_token import resolve_mask_token_id
from tasks.training.rank_environment import PARENT_RUN_VARIABLE, rank_secrets, with_rank_secrets


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

    def __init__(self, draft: DraftModel, steps: int, attention_backend: str = "sdpa",
                 hidden_noise_std: float = 0.0, compiled: bool = False) -> None:
        super().__init__()
        self.draft = draft
        self.steps = steps
        self.attention_backend = attention_backend
        self.hidden_noise_std = hidden_noise_std
        self.loss_fn = compile_draft_parts(draft) if compiled else step_loss

    def forward(self, batch: TTTBatch, normaliser: int) -> tuple[torch.Tensor, TTTOutput]:
        if self.hidden_noise_std > 0:
            batch = with_hidden_noise(batch, self.hidden_noise_std)
        output = draft_objective(self.draft, batch, self.steps, normaliser=normaliser,
                                 attention_backend=self.attention_backend, expected_acceptance=False,
                                 loss_fn=self.loss_fn)
        return output.loss, output


def with_hidden_noise(batch: TTTBatch, std: float) -> TTTBatch:
    """The batch with Gaussian noise of `std` on its aux hidden states (drawn from torch's global generator, whose
    state every checkpoint saves, so a resumed run draws the same noise)."""
    noise = torch.randn(batch.aux_hidden_state.shape, device=batch.aux_hidden_state.device) * std
    return dataclasses.replace(batch, aux_hidden_state=(batch.aux_hidden_state.float() + noise).to(
        batch.aux_hidden_state.dtype))


def run(cfg: RunConfig) -> TrainResult:
    """Train (in this process, or under torchrun when more than one rank is configured); online training with
    `capture.backend: vllm` first starts the engine that computes the features."""
    check_attention_backend(cfg.training.attention_backend)
    with online_capture_engine(cfg):
        if cfg.deployment.trainer.world_size > 1 and "RANK" not in os.environ:
            return launch_ranks(cfg)
        return train(cfg)


def launch_ranks(cfg: RunConfig) -> TrainResult:
    """Run this node's ranks with torchrun (tasks/training/launch.py); their log goes to train/torchrun.log (with
    several nodes train/torchrun-node<R>.log), and the command for each other node is printed first. launch.yaml
    is redacted like every written config; the secrets the ranks need go in their environment
    (tasks/training/rank_environment.py)."""
    trainer = cfg.deployment.trainer
    config_path = launch_config_path(cfg)
    config_path.parent.mkdir(parents=True, exist_ok=True)
    resolved = cfg.model_copy(update={"output_dir": str(cfg.output_path.resolve())})
    with atomic_file(config_path) as handle:
        handle.write(config_as_yaml(resolved))
    parent = parent_run_env()
    for node, line in other_node_commands(cfg, parent.get(PARENT_RUN_VARIABLE)).items():
        print(f"[train] node {node} of {trainer.nnodes}, run on that node: {line}", flush=True)
    command = torchrun_command(cfg, trainer.node_rank)
    log_name = "torchrun.log" if trainer.nnodes == 1 else f"torchrun-node{trainer.node_rank}.log"
    log_path = config_path.parent / log_name
    with open(log_path, "w", encoding="utf-8") as log:
        rank_env = {**os.environ, **parent, **rank_secrets(cfg)}
        completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=rank_env)
    if completed.returncode != 0:
        tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-40:])
        raise TrainingFailed(f"{' '.join(command)} exited with {completed.returncode}; end of {log_path}:\n{tail}")
    summary_path = config_path.parent / "summary.json"
    return TrainResult(summary_path, read_json(summary_path))


def parent_run_env() -> dict[str, str]:
    """Pass the pipeline's active MLflow run down so the ranks' run nests under it."""
    if "mlflow" not in sys.modules:
        return {}
    import mlflow

    active = mlflow.active_run()
    return {PARENT_RUN_VARIABLE: active.info.run_id} if active else {}


def build_draft(cfg: RunConfig, heads: TargetHeads, manifest: dict[str, Any], device: torch.device) -> DraftModel:
    """The seeded initial draft on `device` (heads already there): same weights on every rank."""
    from transformers import AutoConfig

    vocab = load_vocab_mapping(cfg.output_path / "vocab" / "vocab_mapping.safetensors")
    target_config = AutoConfig.from_pretrained(cfg.output_path / "target", trust_remote_code=cfg.model.trust_remote_code)
    torch.manual_seed(cfg.runtime.seed)
    base = Eagle3Config.from_target(target_config, vocab.draft_vocab_size, manifest["aux_layer_ids"])
    config = method_config(base, cfg.draft.method, num_layers=cfg.draft.num_layers,
                           block_size=cfg.training.ttt_length + 1, anchors=cfg.draft.anchors)
    if cfg.draft.method in MASKED_METHODS:
        tokenizer = load_tokenizer(cfg.output_path / "target", cfg.model)
        config.mask_token_id = resolve_mask_token_id(cfg.draft.mask_token_id, tokenizer, config.vocab_size,
                                                     cfg.draft.method)
    draft = new_draft(config)
    draft.set_vocab_mapping(vocab.d2t, vocab.t2d)
    draft.to(device)
    draft.attach_embedding(heads.embedding)
    draft.initialise_from_target(heads.lm_head, heads.final_norm)
    draft.lm_head.weight.requires_grad_(not cfg.training.freeze_lm_head)
    draft.set_dropout(cfg.training.dropout)
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
    draft: DraftModel               # the trained draft; under FSDP its parameters are shards
    full_draft: DraftModel          # a whole copy for rank 0's eval and export under FSDP, else `draft`
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_set: Any                   # FeatureSet (offline) or OnlineFeatures (online)
    eval_set: Any
    heads: TargetHeads
    teacher: Teacher                 # the target's distribution over the draft vocab, in the compute dtype (what
                                     # the loss teaches: renormalised over the draft vocab)
    manifest: dict[str, Any]
    dtype: torch.dtype
    lengths: list[int]
    record_ids: list[str]
    total_steps: int
    math: dict[str, Any]
    state: TrainerState
    tracker: Any = None
    history: list[dict[str, float]] = field(default_factory=list)
    # offline: what the teacher's full-vocabulary pass settled per record the first time it saw it, for the train
    # records and the eval records (stored states give the same values every time; an engine's online states may
    # not, so online runs settle them each time)
    train_cache: Optional[SettledCache] = None
    eval_cache: Optional[SettledCache] = None


def train(cfg: RunConfig) -> TrainResult:
    env = setup_distributed(resolve_device(cfg.runtime.device), cfg.training.collective_timeout_s)
    try:
        return train_ranks(cfg, env)
    finally:
        leave_process_group(env)  # a run that failed before its end left nothing else to wait for


def train_ranks(cfg: RunConfig, env: Distributed) -> TrainResult:
    train_set, eval_set, manifest = open_features(cfg)
    heads = load_target_heads(cfg.output_path / "target").to(env.device)
    draft = build_draft(cfg, heads, manifest, env.device)
    strategy = cfg.deployment.trainer.strategy
    sharded = strategy == "fsdp" and env.world_size > 1
    full_draft = build_draft(cfg, heads, manifest, env.device) if sharded else draft
    module = parallelise(TTTStep(draft, cfg.training.ttt_length, cfg.training.attention_backend,
                                 cfg.training.hidden_noise_std, cfg.training.compile), strategy, env)
    trainable = [parameter for parameter in module.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.training.learning_rate, weight_decay=cfg.training.weight_decay)
    index = train_set.index()  # offline: every shard's header and offsets
    record_ids = [record_id for record_id, _ in index]
    lengths = [length for _, length in index]
    shard_of = train_set.shard_of()
    plans = [optimizer_steps(epoch_batches(lengths, cfg.training.tokens_per_step, cfg.runtime.seed, epoch, shard_of,
                                           cfg.training.shuffle_buffer_shards, cfg.training.length_window),
                             cfg.training.grad_accumulation)
             for epoch in range(cfg.training.epochs)]
    total_steps = min(cfg.training.max_steps or 10**12, sum(len(plan) for plan in plans))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(total_steps, cfg.training.warmup_ratio))
    dtype = compute_dtype(cfg.training.precision, env.device)
    shuffle_groups = math.ceil(len(set(shard_of)) / cfg.training.shuffle_buffer_shards)
    math_now = math_fields(cfg, env.world_size, manifest.get("fingerprint", ""), str(dtype).removeprefix("torch."),
                           shuffle_groups)
    code = training_code_fingerprint()
    state = TrainerState(step=0, cursor=Cursor(), math=math_now, scheduler={}, eval_metrics={}, code=code)
    point = resume_point(cfg.output_path / "checkpoints", cfg.training.resume_from, math_now, code)
    if point.checkpoint is None:
        start_fresh(cfg, env, point.other_code)
    else:
        loaded = load_checkpoint(point.checkpoint, env.rank)
        load_full_state(module, optimizer, loaded.weights, loaded.optimizer_state)
        state = loaded.state
        state.code = code  # the checkpoints it writes from here on
        scheduler.load_state_dict(state.scheduler)
    kept_steps = cut_step_log(cfg.output_path, state.step) if env.is_main and state.step else []
    env.barrier()
    teacher = Teacher(heads.lm_head, draft.t2d, dtype, outside_mass=False)  # training steps; evaluate() adds the mass
    loop = Loop(cfg, env, draft, full_draft, module, optimizer, scheduler, train_set, eval_set, heads, teacher, manifest,
                dtype, lengths, record_ids, total_steps, math_now, state)
    if cfg.training.mode == "offline":
        loop.train_cache, loop.eval_cache = SettledCache(), SettledCache()
    with training_tracker(cfg, env) as tracker:
        loop.tracker = tracker
        if tracker is not None:
            replay_step_metrics(tracker, kept_steps)
        before = evaluate(loop) if state.step == 0 else {}
        run_steps(loop, plans)
        ending = end_of_training(loop, before)
        leave_process_group(env)  # the last collective is behind: rank 0's slow I/O below holds no rank waiting
        if not env.is_main:
            return TrainResult(ending.summary_path, {})  # the summary is rank 0's to write
        return publish(ending, tracker)


def open_features(cfg: RunConfig) -> tuple[Any, Any, dict[str, Any]]:
    """(train source, eval source or None, features manifest) for the configured training mode."""
    if cfg.training.mode == "online":
        from tasks.features.online import open_online

        return open_online(cfg)
    features_dir = cfg.output_path / "features"
    train_set = FeatureSet(features_dir, "train")
    check_manifest(train_set.manifest, cfg, read_json(cfg.output_path / "target.json"))
    has_eval = train_set.manifest["splits"].get("eval", {}).get("records")
    return train_set, FeatureSet(features_dir, "eval") if has_eval else None, train_set.manifest


def start_fresh(cfg: RunConfig, env: Distributed, other_code: Optional[Path] = None) -> None:
    """A run that starts over sets the previous run's checkpoints, step log and exports aside (never deletes them).
    `other_code`: the newest checkpoint, which `auto` does not continue because other code wrote it."""
    if env.is_main:
        folder = set_aside(cfg.output_path)
        if folder is not None:
            reason = (f"{other_code.name} was written by other code (the train stage's code changed)"
                      if other_code is not None else f"training.resume_from={cfg.training.resume_from}")
            print(f"[train] starting over ({reason}): the previous run's checkpoints, step log and exports moved to "
                  f"{folder}", flush=True)
    env.barrier()


def run_steps(loop: Loop, plans: list[list[list[list[int]]]]) -> None:
    """The step loop, from the state's cursor; stops at total_steps or after training.halt_after steps."""
    cfg, state = loop.cfg, loop.state
    halt_at = state.step + cfg.training.halt_after if cfg.training.halt_after else None
    last_step = min(loop.total_steps, halt_at) if halt_at is not None else loop.total_steps
    streaming = stream_features(loop, plans, last_step - state.step)
    try:
        step_through(loop, plans, halt_at)
    finally:
        if streaming:
            loop.train_set.close()


def stream_features(loop: Loop, plans: list[list[list[list[int]]]], steps: int) -> bool:
    """Online features from an engine: hand this rank's coming micro-batches to the producer (bounded queue);
    False when the features come another way."""
    features = loop.train_set
    if not isinstance(getattr(features, "source", None), EngineStates):
        return False
    env, cursor = loop.env, loop.state.cursor
    coming: list[list[int]] = []
    for epoch in range(cursor.epoch, len(plans)):
        start = cursor.batch if epoch == cursor.epoch else 0
        for step in plans[epoch][start:]:
            if steps <= 0:
                break
            steps -= 1
            coming.extend(rank_share(batch, env.rank, env.world_size) or batch[:1] for batch in step)
    features.stream(coming, loop.cfg.training.prefetch_batches)
    return True


def step_through(loop: Loop, plans: list[list[list[list[int]]]], halt_at: int | None) -> None:
    from tasks.common.progress import progress_bar

    state = loop.state
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


@dataclass
class StepTotals:
    """Sums over the micro-batches of one optimizer step (then over ranks)."""

    loss: float = 0.0
    ploss: list[float] = field(default_factory=list)
    correct: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)
    tokens: float = 0.0
    waited: float = 0.0
    supervised_tokens: float = 0.0

    def add(self, loss: torch.Tensor, output: TTTOutput, tokens: int, waited: float, supervised_tokens: int) -> None:
        steps = len(output.acc)
        if not self.ploss:
            self.ploss, self.correct, self.counts = [0.0] * steps, [0.0] * steps, [0.0] * steps
        self.loss += float(loss.detach())
        for step in range(steps):
            self.ploss[step] += float(output.ploss[step].detach())
            self.correct[step] += output.acc[step] * output.supervised[step]
            self.counts[step] += output.supervised[step]
        self.tokens += tokens
        self.waited += waited
        self.supervised_tokens += supervised_tokens

    def flat(self) -> list[float]:
        return [self.loss, *self.ploss, *self.correct, *self.counts, self.tokens, self.waited, self.supervised_tokens]


def micro_batch(loop: Loop, global_batch: list[int]) -> tuple[TTTBatch, list[dict[str, Any]]]:
    """This rank's share of one micro-batch. A rank left without a record (more ranks than records) gets a
    zero-weight copy of the first one, so the collective calls still line up."""
    env = loop.env
    mine = rank_share(global_batch, env.rank, env.world_size)
    keys = mine or global_batch[:1]
    records = loop.train_set.records(keys)
    batch = collate(records, loop.teacher, keys=keys, cache=loop.train_cache)
    if not mine:
        batch.loss_mask.zero_()
        records = []
    return batch, records


def train_step(loop: Loop, micro_batches: list[list[int]]) -> dict[str, float]:
    """One optimizer step over `grad_accumulation` micro-batches, normalised by all their tokens together,
    so it equals one step on their union."""
    env = loop.env
    started = time.perf_counter()
    normaliser = sum(loop.lengths[index] for batch in micro_batches for index in batch)
    totals = StepTotals()
    for position, global_batch in enumerate(micro_batches):
        fetched = time.perf_counter()
        batch, records = micro_batch(loop, global_batch)
        waited = time.perf_counter() - fetched
        with gradient_sync(loop.module, enabled=position == len(micro_batches) - 1):
            with autocast(env.device, loop.dtype):
                loss, output = loop.module(batch, normaliser)
            (loss * env.world_size).backward()
        totals.add(loss, output, sum(len(record["input_ids"]) for record in records), waited,
                   sum(int(record["loss_mask"].sum()) for record in records))
    finite = env.all_sum([0.0 if math.isfinite(totals.loss) else 1.0])[0] == 0.0
    if not finite:
        ids = [loop.record_ids[index] for batch in micro_batches for index in batch]
        raise TrainingDiverged(f"loss is not finite at step {loop.state.step + 1} (records {', '.join(ids)})")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(loop.module.parameters(), loop.cfg.training.max_grad_norm))
    loop.optimizer.step()
    loop.scheduler.step()
    loop.optimizer.zero_grad(set_to_none=True)
    return step_metrics(loop, env.all_sum(totals.flat()), len(totals.ploss), time.perf_counter() - started, grad_norm)


def step_metrics(loop: Loop, reduced: list[float], steps: int, elapsed: float, grad_norm: float) -> dict[str, float]:
    """Per-step numbers from the rank-summed StepTotals.flat()."""
    metrics = {"loss": reduced[0], "lr": loop.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
               "tokens": reduced[1 + 3 * steps], "step_seconds": elapsed,
               "tokens_per_second": reduced[1 + 3 * steps] / elapsed,
               "data_wait_share": reduced[2 + 3 * steps] / loop.env.world_size / elapsed,
               "supervised_tokens": reduced[3 + 3 * steps]}
    for step in range(steps):
        metrics[f"ploss_{step}"] = reduced[1 + step]
        total = reduced[1 + 2 * steps + step]
        metrics[f"acc_{step}"] = reduced[1 + steps + step] / total if total else 0.0
    return metrics


def supervised_share(history: list[dict[str, float]]) -> dict[str, float]:
    """{"supervised_share": supervised tokens / tokens trained} over the logged steps that counted them (none for
    steps replayed from a run before the count existed): the share of a token's rows where the teacher and the
    draft's lm_head run (tasks/common/roofline.py counts their FLOPs with it)."""
    counted = [entry for entry in history if "supervised_tokens" in entry]
    tokens = sum(entry["tokens"] for entry in counted)
    if not tokens:
        return {}
    return {"supervised_share": sum(entry["supervised_tokens"] for entry in counted) / tokens}


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
    if state.step % cfg.training.eval_interval == 0 or last:
        state.eval_metrics = evaluate(loop)
        if env.is_main and loop.tracker is not None and state.eval_metrics:
            loop.tracker.log_metrics({f"eval.{key}": value for key, value in state.eval_metrics.items()}, step=state.step)
    if state.step % cfg.training.save_interval == 0 or last:
        save(loop)


def save(loop: Loop) -> None:
    """A checkpoint of the full state (every rank takes part: the weights may be sharded)."""
    env, state = loop.env, loop.state
    rngs = env.gather(rng_state())
    weights = full_draft_weights(loop.module)
    optimizer_state = full_optimizer_state(loop.module, loop.optimizer)
    if env.is_main:
        root = loop.cfg.output_path / "checkpoints"
        state.scheduler = loop.scheduler.state_dict()
        directory = save_checkpoint(root, weights, optimizer_state, state, rngs, config_as_yaml(loop.cfg))
        score = state.eval_metrics.get("simulated_accept_len")
        if score is not None and (state.best_simulated_accept_len is None or score > state.best_simulated_accept_len):
            state.best_simulated_accept_len = score
            record_best(root, directory, score)
        prune_checkpoints(root, loop.cfg.training.keep_last)
    env.barrier()


def gathered_draft(loop: Loop, every_rank: bool = False) -> DraftModel:
    """The whole draft as it is now, for rank 0, or for each rank with `every_rank` (under FSDP every rank must
    call this: it gathers)."""
    if loop.full_draft is not loop.draft:
        weights = full_draft_weights(loop.module, every_rank)
        if every_rank or loop.env.is_main:
            loop.full_draft.load_state_dict(weights)
    return loop.full_draft


def evaluate(loop: Loop) -> dict[str, float]:
    """Eval acceptance metrics of the draft being trained: each rank evaluates its share of the eval records and
    one all-reduce adds up their counts, so no rank waits in a collective while another evaluates everything
    (every rank calls this and gets the metrics)."""
    if loop.eval_set is None:
        return {}
    draft = gathered_draft(loop, every_rank=True)
    return evaluate_features(draft, loop.eval_set, loop.teacher.with_outside_mass(True), loop.cfg.training.ttt_length,
                             loop.cfg.training.attention_backend, loop.eval_cache, loop.env)


@dataclass
class EvalTotals:
    """Sums over evaluated records, per depth, and the number of records: the ranks add theirs up with one
    all-reduce, so the metrics of the sum are one rank's over every record (an average of the ranks' averages
    would weigh a rank's few supervised positions like another's many)."""

    correct: list[float]
    counts: list[float]
    accepted: list[float]
    ploss: list[float]
    records: float = 0.0

    @classmethod
    def empty(cls, steps: int) -> "EvalTotals":
        return cls([0.0] * steps, [0.0] * steps, [0.0] * steps, [0.0] * steps)

    @classmethod
    def from_flat(cls, values: list[float], steps: int) -> "EvalTotals":
        """The inverse of flat()."""
        parts = [list(values[start:start + steps]) for start in range(0, 4 * steps, steps)]
        return cls(*parts, records=values[4 * steps])

    def flat(self) -> list[float]:
        return [*self.correct, *self.counts, *self.accepted, *self.ploss, self.records]

    def add(self, output: TTTOutput) -> None:
        """One record's draft objective."""
        for step in range(len(self.counts)):
            self.counts[step] += output.supervised[step]
            self.correct[step] += output.acc[step] * output.supervised[step]
            self.accepted[step] += output.expected_accept[step] * output.supervised[step]
            self.ploss[step] += float(output.ploss[step])
        self.records += 1

    def metrics(self) -> dict[str, float]:
        """acc_k and expected acceptance weighted by supervised positions, ploss_k per record, and the simulated
        accept length of the chain."""
        metrics: dict[str, float] = {}
        steps = len(self.counts)
        for step in range(steps):
            count = self.counts[step]
            metrics[f"acc_{step}"] = self.correct[step] / count if count else 0.0
            metrics[f"expected_accept_{step}"] = self.accepted[step] / count if count else 0.0
            metrics[f"ploss_{step}"] = self.ploss[step] / self.records if self.records else 0.0
        metrics["simulated_accept_len"] = simulated_accept_length([metrics[f"acc_{step}"] for step in range(steps)])
        return metrics


EVAL_FETCH = 8  # eval records fetched at once (an online source computes each fetch as one pass of the target)


def records_at(features: Any, positions: list[int]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(position, record) for each of `positions`, fetched EVAL_FETCH at a time."""
    fetch = getattr(features, "records", None)
    for start in range(0, len(positions), EVAL_FETCH):
        chunk = positions[start:start + EVAL_FETCH]
        records = fetch(chunk) if fetch is not None else [features[position] for position in chunk]
        yield from zip(chunk, records)


def eval_totals(draft: DraftModel, features: Any, teacher: Teacher, steps: int, positions: list[int],
                attention_backend: str = "sdpa", cache: Optional[SettledCache] = None) -> EvalTotals:
    """The sums over the records at `positions` (one rank's share of the eval records)."""
    totals = EvalTotals.empty(steps)
    with torch.no_grad(), autocast(teacher.device, teacher.dtype), evaluation_mode(draft):
        for position, record in records_at(features, positions):
            totals.add(draft_objective(draft, collate([record], teacher, keys=[position], cache=cache), steps,
                                       attention_backend=attention_backend, evaluation=True))
    return totals


def evaluate_features(draft: DraftModel, features: Any, teacher: Teacher, steps: int,
                      attention_backend: str = "sdpa", cache: Optional[SettledCache] = None,
                      env: Optional[Distributed] = None) -> dict[str, float]:
    """acc_k, expected acceptance and ploss per depth over every record, weighted by supervised positions,
    and the simulated accept length of a chain of `steps` (in the teacher's compute dtype). `cache`: the
    teacher's settled values of these records by position, kept from one evaluation to the next. `env`: the
    ranks; each evaluates its share and every rank returns the metrics of them all (a collective)."""
    env = env or Distributed()
    positions = rank_share(list(range(len(features))), env.rank, env.world_size)
    totals = eval_totals(draft, features, teacher, steps, positions, attention_backend, cache)
    return EvalTotals.from_flat(env.all_sum(totals.flat()), steps).metrics()


@contextmanager
def evaluation_mode(draft: DraftModel) -> Iterator[None]:
    """The draft without training-only randomness (dropout), restored to its mode afterwards."""
    was_training = draft.training
    draft.eval()
    try:
        yield
    finally:
        draft.train(was_training)


@dataclass
class Ending:
    """What rank 0 publishes at the end of a run, once the process group is left: publish() waits for no other
    rank, so rank 0's slow I/O (the exports, MLflow's uploads) never holds a rank in a collective."""

    cfg: RunConfig
    draft: DraftModel               # the whole draft (gathered under FSDP when the run is complete)
    state: TrainerState
    total_steps: int
    world_size: int
    manifest: dict[str, Any]
    precision: str
    history: list[dict[str, float]]
    before: dict[str, float]        # the untrained draft's eval metrics (empty for a resumed run)

    @property
    def complete(self) -> bool:
        return self.state.step >= self.total_steps

    @property
    def summary_path(self) -> Path:
        return self.cfg.output_path / "train" / "summary.json"


def end_of_training(loop: Loop, before: dict[str, float]) -> Ending:
    """The run's last collective (under FSDP, a complete run's whole draft gathered to rank 0) and what rank 0
    publishes after it (every rank calls this)."""
    complete = loop.state.step >= loop.total_steps
    draft = gathered_draft(loop) if complete else loop.full_draft
    return Ending(loop.cfg, draft, loop.state, loop.total_steps, loop.env.world_size, loop.manifest,
                  loop.math["training.precision"], loop.history, before)


def publish(ending: Ending, tracker: Any = None) -> TrainResult:
    """Rank 0, after the last collective: export the draft for each engine, plot accuracy by depth, write the
    summary, and log the plot and the exports to the MLflow run `tracker` (None: tracking is off)."""
    cfg, state = ending.cfg, ending.state
    train_dir = cfg.output_path / "train"
    if ending.complete:
        export(cfg, ending.draft, ending.manifest, state.step, ending.world_size, state.eval_metrics, ending.precision)
    plot = plot_accuracy(state.eval_metrics, ending.before, train_dir / "accuracy_by_depth.png")
    summary = {"steps": state.step, "total_steps": ending.total_steps, "complete": ending.complete,
               "world_size": ending.world_size, "strategy": cfg.deployment.trainer.strategy, "mode": cfg.training.mode,
               "precision": ending.precision, "host": host_compute().as_record(),
               **{f"eval_{key}": value for key, value in state.eval_metrics.items()},
               **{f"untrained_{key}": value for key, value in ending.before.items() if key == "simulated_accept_len"}}
    history = ending.history
    if history:
        summary["tokens_per_second"] = sum(entry["tokens_per_second"] for entry in history) / len(history)
        summary["data_wait_share"] = sum(entry["data_wait_share"] for entry in history) / len(history)
        summary.update(supervised_share(history))
    write_json(ending.summary_path, summary)
    if tracker is not None:
        tracker.set_tags({"eaglet.precision": ending.precision, "eaglet.cpu_flags": " ".join(host_compute().flags)})
        if plot is not None:
            tracker.log_artifact(str(plot), "train")
        for engine in ENGINES:
            if (cfg.output_path / "draft" / engine).is_dir():
                tracker.log_artifacts(str(cfg.output_path / "draft" / engine), f"draft/{engine}")
    return TrainResult(ending.summary_path, read_json(ending.summary_path))


def main() -> None:
    """Entry point of each torchrun rank."""
    parser = argparse.ArgumentParser(description="eaglet training rank (started by `eaglet stage train`)")
    parser.add_argument("--config", required=True)
    arguments = parser.parse_args()
    train(with_rank_secrets(load_config(arguments.config)))


if __name__ == "__main__":
    main()
