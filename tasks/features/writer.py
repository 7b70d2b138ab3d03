"""Shards: which records go in each, whether one on disk is still current, and writing one atomically.

A shard holds `capture.records_per_shard` records packed along the token axis (format: tasks/features/shards.py).
It is written to a temp name and renamed, hashing the bytes on the way; a rerun keeps every shard whose
records, tokens and capture settings are unchanged and still readable.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from contract.config import RunConfig
from models.target_capture import teacher_topk
from models.vocab_mapping import VocabMapping, write_safetensors
from tasks.common.artifacts import atomic_file
from tasks.features.preparation import SPLITS, Sample
from tasks.features.shards import SHARD_SCHEMA, FeatureError, load_shard, quantise_aux
from tasks.features.state_sources import StateSource

SHARD_NAME = "shard-{:05d}.safetensors"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ShardPlan:
    split: str
    index: int
    samples: list[Sample]
    path: Path

    @property
    def file(self) -> str:
        return f"{self.split}/{self.path.name}"

    @property
    def tokens(self) -> int:
        return sum(len(sample.input_ids) for sample in self.samples)

    def input_hash(self) -> str:
        """Identifies exactly which tokens and masks the shard holds."""
        digest = hashlib.sha256()
        for sample in self.samples:
            digest.update(json.dumps([sample.id, sample.input_ids, sample.loss_mask]).encode())
        return digest.hexdigest()


def plan_shards(features_dir: Path, split: str, samples: list[Sample], per_shard: int) -> list[ShardPlan]:
    return [ShardPlan(split, index, samples[start:start + per_shard],
                      features_dir / split / SHARD_NAME.format(index))
            for index, start in enumerate(range(0, len(samples), per_shard))]


def shard_is_current(plan: ShardPlan, fingerprint: str, mode: str) -> bool:
    """True when the shard on disk is readable and holds exactly the planned records under these settings."""
    if not plan.path.is_file():
        return False
    try:
        tensors, record_ids, metadata = load_shard(plan.path, mode)
    except FeatureError as error:
        print(f"[capture] rewriting {plan.path}: {error}", flush=True)
        return False
    return (metadata.get("fingerprint") == fingerprint and metadata.get("input_hash") == plan.input_hash()
            and record_ids == [sample.id for sample in plan.samples] and int(tensors["offsets"][-1]) == plan.tokens)


def remove_stale_files(features_dir: Path, plans: list[ShardPlan]) -> None:
    """Shards beyond the plan (an earlier, larger run) and temp files of a killed run."""
    planned = {plan.path for plan in plans}
    for split in SPLITS:
        directory = features_dir / split
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            stale_shard = path.name.startswith("shard-") and path.suffix == ".safetensors" and path not in planned
            if stale_shard or (path.name.startswith(".shard-") and path.name.endswith(".tmp")):
                path.unlink()


class HashingWriter:
    """A binary handle that hashes what passes through it."""

    def __init__(self, handle: Any) -> None:
        self.handle, self.digest = handle, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self.handle.write(data)


def write_shard(plan: ShardPlan, source: StateSource, cfg: RunConfig, mapping: VocabMapping, fingerprint: str,
                advance_by: Any) -> str:
    """Take the shard's records' states from `source` (length-sorted batches) and write the shard atomically;
    returns its sha256."""
    settings = cfg.capture
    per_record: list[dict[str, torch.Tensor]] = [{} for _ in plan.samples]
    order = sorted(range(len(plan.samples)), key=lambda i: len(plan.samples[i].input_ids), reverse=True)
    draft_ids = mapping.used_ids
    for start in range(0, len(order), source.batch_size):
        batch = order[start:start + source.batch_size]
        states = source.states([plan.samples[i] for i in batch])
        for index, (aux, hidden) in zip(batch, states):
            sample = plan.samples[index]
            if settings.mode == "lossless":
                per_record[index] = lossless_tensors(sample, aux, hidden, settings.dtype)
            else:
                tensors = per_record[index]
                tensors.update(token_tensors(sample))
                aux_layers = aux.shape[-1] // hidden.shape[-1]
                tensors["aux_hidden_state"], tensors["aux_scale"] = quantise_aux(aux.cpu(), aux_layers)
                ids, logprobs, top1 = teacher_topk(source.head_model(), hidden, draft_ids, settings.compact_topk)
                tensors.update(teacher_topk_ids=ids, teacher_topk_logprobs=logprobs, target_top1=top1)
        advance_by(len(batch))
    lengths = torch.tensor([0] + [len(sample.input_ids) for sample in plan.samples], dtype=torch.int64)
    pieces: dict[str, Any] = {name: [tensors[name] for tensors in per_record] for name in per_record[0]}
    pieces["offsets"] = torch.cumsum(lengths, 0)
    metadata = {"schema": SHARD_SCHEMA, "split": plan.split, "mode": settings.mode, "fingerprint": fingerprint,
                "input_hash": plan.input_hash(), "record_ids": json.dumps([sample.id for sample in plan.samples])}
    with atomic_file(plan.path, "wb") as handle:
        writer = HashingWriter(handle)
        write_safetensors(writer, pieces, metadata)
    return writer.digest.hexdigest()


def token_tensors(sample: Sample) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor(sample.input_ids, dtype=torch.int32),
            "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.uint8)}


def lossless_tensors(sample: Sample, aux: torch.Tensor, hidden: torch.Tensor, dtype: str,
                     device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """One record's lossless features, stored in `capture.dtype` (online training rounds the same way)."""
    return {**token_tensors(sample), "aux_hidden_state": aux.to(device, DTYPES[dtype]),
            "hidden_state": hidden.to(device, DTYPES[dtype])}
