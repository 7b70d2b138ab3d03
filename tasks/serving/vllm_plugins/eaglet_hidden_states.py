"""A hidden-states connector for vLLM's `extract_hidden_states` method that also runs on vLLM's CPU build.

This module is imported by the vLLM engine process (its own venv), never by eaglet: tasks/features/engine_states.py
puts this folder on the engine's PYTHONPATH and names the class in `--kv-transfer-config`
(`kv_connector_module_path: eaglet_hidden_states`).

vLLM's ExampleHiddenStatesConnector stores each finished request's states (the requested layers, [T, k, H], and
the prompt's `token_ids`) as one safetensors file whose path comes back in the response's `kv_transfer_params`,
and holds an exclusive lock on `<file>.lock` until the file is written. Its copy out of the cache assumes a GPU:
pinned host memory and a CUDA stream and event. Here the cache already lives in host memory, so the rows are
gathered and cloned before this method returns (the cache blocks can be reused at once) and only the disk
write runs on the connector's writer threads. Everything else is vLLM's own behaviour, unchanged.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
)


class CopyFinished:
    """Stands in for the CUDA event the base class waits on: a host-memory copy is finished when it returns."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def cache_rows(cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` cache rows of a request, [T, k, H], from a [blocks, k, block_size, H] cache."""
    block_size = cache.shape[2]
    blocks = torch.tensor(block_ids, dtype=torch.long)
    slots = (blocks.reshape(-1, 1) * block_size + torch.arange(block_size).reshape(1, -1)).flatten()[:num_tokens]
    return cache[slots // block_size, :, slots % block_size].to("cpu", copy=True)


class EagletHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with a host-memory copy instead of a CUDA-stream copy."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("the hidden-states cache was never registered")
        tensors = {
            "hidden_states": cache_rows(self._kv_cache, pending.block_ids, int(pending.token_ids.shape[0])),
            "token_ids": pending.token_ids.clone(),
        }
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        finished = CopyFinished()
        future = self._executor.submit(self._write_tensors, tensors, finished, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = finished
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
