"""Features computed while training (`training.mode: online`): no shards on disk.

The records are tokenised and masked exactly as the capture stage does (tasks/features/preparation.prepare_inputs,
which also writes the vocab mapping), and their states come from a state source (tasks/features/state_sources.py):
the target inside the training process (`capture.backend: local`, the same hooks as capture), or a vLLM server
the train stage starts (`capture.backend: vllm`, tasks/features/engine_states.py), a producer that is not the
trainer. The states are rounded to `capture.dtype` like lossless shards, so online and offline training see the
same numbers and give the same loss.

With the engine, the trainer hands this rank's coming micro-batches to `stream`: a producer thread asks the engine
for them in order and keeps at most `training.prefetch_batches` ready in a bounded queue, so the trainer consumes
features as they arrive (its `data_wait_share` says how long it still waited).

    features = OnlineFeatures(inputs.samples["train"], LocalStates(target, aux_ids, pad_id, 8), "bfloat16")
    features.records([3, 7])   # [{"id", "input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}, ...]
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Iterator, Optional, Sequence

from tasks.common.target_info import features_dtype, load_target_model, pad_token_id
from tasks.features.engine_states import CAPTURE_URL_VARIABLE, EngineStates, engine_layer_ids
from tasks.features.manifest import build_manifest
from tasks.features.preparation import Sample, prepare_inputs
from tasks.features.state_sources import LocalStates, StateSource
from tasks.features.writer import lossless_tensors


class OnlineFeatures:
    """The records of one split as lossless feature dicts, computed by a state source when asked for."""

    mode = "lossless"

    def __init__(self, samples: list[Sample], source: StateSource, dtype: str) -> None:
        self.samples = samples
        self.source = source
        self.dtype = dtype
        self.ready: Optional[queue.Queue] = None
        self.expected: list[list[int]] = []
        self.stop = threading.Event()

    def __len__(self) -> int:
        return len(self.samples)

    def index(self) -> list[tuple[str, int]]:
        return [(sample.id, len(sample.input_ids)) for sample in self.samples]

    def shard_of(self) -> list[int]:
        """No shards: every record is in one shuffle group (the plain seeded shuffle, as offline with few shards)."""
        return [0] * len(self.samples)

    def compute(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The records at `indices`, `source.batch_size` at a time, in the order asked."""
        records: list[dict[str, Any]] = []
        for start in range(0, len(indices), self.source.batch_size):
            chosen = [self.samples[index] for index in indices[start:start + self.source.batch_size]]
            states = self.source.states(chosen)
            for sample, (aux, hidden) in zip(chosen, states):
                records.append({"id": sample.id, **lossless_tensors(sample, aux, hidden, self.dtype, aux.device)})
        return records

    def stream(self, batches: list[list[int]], depth: int) -> None:
        """Compute `batches` in order on a producer thread, at most `depth` ahead of the consumer."""
        self.close()
        self.stop = threading.Event()
        self.ready = queue.Queue(maxsize=depth)
        self.expected = [list(batch) for batch in batches]
        threading.Thread(target=self.produce, args=(list(self.expected), self.ready, self.stop), daemon=True).start()

    def produce(self, batches: list[list[int]], ready: queue.Queue, stop: threading.Event) -> None:
        for batch in batches:
            try:
                item: Any = self.compute(batch)
            except Exception as problem:  # handed to the consumer, which raises it where the batch was wanted
                item = problem
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if stop.is_set() or isinstance(item, Exception):
                return

    def close(self) -> None:
        """Stop the producer (a halted or finished run leaves batches it will not use)."""
        self.stop.set()
        self.ready, self.expected = None, []

    def records(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The next streamed batch when it is the one asked for, else computed now."""
        if self.ready is not None and self.expected and self.expected[0] == list(indices):
            self.expected.pop(0)
            item = self.ready.get()
            if isinstance(item, Exception):
                raise item
            return item
        return self.compute(indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.records([index])[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for start in range(0, len(self), self.source.batch_size):
            yield from self.compute(range(start, min(start + self.source.batch_size, len(self))))


def online_source(cfg: Any, inputs: Any) -> tuple[StateSource, dict[str, Any]]:
    """The state source `capture.backend` names for online training, and the manifest's `producer`."""
    if cfg.capture.backend == "vllm":
        url = os.environ.get(CAPTURE_URL_VARIABLE)
        if not url:
            raise RuntimeError(f"capture.backend vllm with online training: {CAPTURE_URL_VARIABLE} is not set; the "
                               "train stage starts the engine and sets it (run `eaglet stage train`)")
        layer_ids = engine_layer_ids(inputs.aux_ids, inputs.info.num_hidden_layers)
        source = EngineStates.from_url(cfg, url, layer_ids)
        return source, {"backend": "vllm", "engine": "vllm", "online": True, "dtype": features_dtype(cfg),
                        "engine_layer_ids": layer_ids}
    target = load_target_model(cfg, cfg.output_path / "target", features_dtype(cfg))
    target.eval()
    source = LocalStates(target, inputs.aux_ids, pad_token_id(inputs.tokenizer), cfg.capture.batch_size)
    return source, {"backend": "online", "engine": "transformers, in the trainer", "dtype": features_dtype(cfg)}


def open_online(cfg: Any) -> tuple[OnlineFeatures, Optional[OnlineFeatures], dict[str, Any]]:
    """Train and eval sources plus the manifest the trainer reads (aux ids, vocab hash, fingerprint)."""
    inputs = prepare_inputs(cfg)
    source, producer = online_source(cfg, inputs)
    sources = {split: OnlineFeatures(inputs.samples[split], source, cfg.capture.dtype) for split in ("train", "eval")}
    eval_source = sources["eval"] if len(sources["eval"]) else None
    return sources["train"], eval_source, build_manifest(cfg, inputs, [], {}, producer)
