"""Where the capture stage gets the target's states: the target in-process, or a serving engine.

A source turns records into `(aux [T, 3H], hidden [T, H])` pairs in the target's dtype, exactly as
models/target_capture.py defines them (aux: outputs of the aux decoder layers side by side; hidden: the final
normed state), and offers the lm_head that compact mode's teacher is computed with. The shard writer cannot tell
the sources apart; `capture.backend` picks one (local here, vllm in tasks/features/engine_states.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from models.target_capture import capture_states
from tasks.features.preparation import Sample

States = list[tuple[torch.Tensor, torch.Tensor]]


class StateSource(Protocol):
    #: records handed to `states` at once (a forward pass's batch, or requests in flight to an engine)
    batch_size: int

    def states(self, samples: list[Sample]) -> States:
        """(aux, hidden) of each sample, in order."""
        ...

    def head_model(self) -> Any:
        """A module whose `get_output_embeddings()` is the target's lm_head (compact mode's teacher)."""
        ...


@dataclass
class LocalStates:
    """The target in this process: one right-padded forward pass per batch, hooks on the decoder layers.

    One forward at a time: the hooks sit on one model, and two threads running forwards through it at once would
    mix their states (online training's producer thread computing the next train batch while the trainer computes
    an eval batch on the spot, both from this source)."""

    model: Any
    aux_ids: list[int]
    pad_id: int
    batch_size: int
    forward_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def states(self, samples: list[Sample]) -> States:
        with self.forward_lock:
            return capture_states(self.model, [sample.input_ids for sample in samples], self.aux_ids,
                                  pad_token_id=self.pad_id)

    def head_model(self) -> Any:
        return self.model
