"""Features computed by the target inside the training process (`training.mode: online`): no shards on disk.

The records are tokenised and masked exactly as the capture stage does (tasks/features/preparation.prepare_inputs,
which also writes the vocab mapping), and each batch runs through the target with the same hooks
(models/target_capture.capture_states). The states are rounded to `capture.dtype` like lossless shards, so
online and offline training see the same numbers and give the same loss.

    features = OnlineFeatures(inputs.samples["train"], target, inputs.aux_ids, "bfloat16", pad_id=0)
    features.records([3, 7])   # [{"id", "input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}, ...]
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

from models.target_capture import capture_states
from tasks.common.target_info import load_target_model, pad_token_id
from tasks.features.manifest import build_manifest
from tasks.features.preparation import Sample, prepare_inputs
from tasks.features.writer import lossless_tensors


class OnlineFeatures:
    """The records of one split as lossless feature dicts, produced by the target when asked for."""

    mode = "lossless"

    def __init__(self, samples: list[Sample], target: Any, aux_ids: list[int], dtype: str, pad_id: int,
                 batch_size: int = 8) -> None:
        self.samples = samples
        self.target = target
        self.aux_ids = aux_ids
        self.dtype = dtype
        self.pad_id = pad_id
        self.batch_size = batch_size

    def __len__(self) -> int:
        return len(self.samples)

    def index(self) -> list[tuple[str, int]]:
        return [(sample.id, len(sample.input_ids)) for sample in self.samples]

    def shard_of(self) -> list[int]:
        """No shards: every record is in one shuffle group (the plain seeded shuffle, as offline with few shards)."""
        return [0] * len(self.samples)

    def records(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """One padded target forward per `batch_size` records, in the order asked."""
        records: list[dict[str, Any]] = []
        for start in range(0, len(indices), self.batch_size):
            chosen = [self.samples[index] for index in indices[start:start + self.batch_size]]
            states = capture_states(self.target, [sample.input_ids for sample in chosen], self.aux_ids,
                                    pad_token_id=self.pad_id)
            for sample, (aux, hidden) in zip(chosen, states):
                records.append({"id": sample.id, **lossless_tensors(sample, aux, hidden, self.dtype, aux.device)})
        return records

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.records([index])[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for start in range(0, len(self), self.batch_size):
            yield from self.records(range(start, min(start + self.batch_size, len(self))))


def open_online(cfg: Any) -> tuple[OnlineFeatures, Optional[OnlineFeatures], dict[str, Any]]:
    """Train and eval sources plus the manifest the trainer reads (aux ids, vocab hash, fingerprint)."""
    inputs = prepare_inputs(cfg)
    target = load_target_model(cfg, cfg.output_path / "target")
    target.eval()
    sources = {split: OnlineFeatures(inputs.samples[split], target, inputs.aux_ids, cfg.capture.dtype,
                                     pad_token_id(inputs.tokenizer), cfg.capture.batch_size)
               for split in ("train", "eval")}
    eval_source = sources["eval"] if len(sources["eval"]) else None
    producer = {"backend": "online", "engine": "transformers, in the trainer", "dtype": cfg.model.dtype}
    return sources["train"], eval_source, build_manifest(cfg, inputs, [], {}, producer)
