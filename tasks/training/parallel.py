"""How the training step is spread over ranks: DDP (default) or FSDP2 `fully_shard`, and full-state I/O.

DDP keeps a full draft on every rank and all-reduces gradients; it suits the draft (one decoder layer).
FSDP2 shards parameters, gradients and AdamW state across ranks, for drafts whose draft vocabulary makes
the lm_head and its optimizer state large. The whole TTT module is one FSDP unit, so its parameters are
gathered when the module is called (ttt_forward calls the draft's parts directly, below that hook).

Checkpoints always hold *full* (unsharded) draft weights and optimizer state keyed by parameter name, so a
run saved under one strategy or world size reads the same everywhere, and rank 0 can evaluate and export.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

STRATEGIES = ("ddp", "fsdp")
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to rank 0, on CPU
EVERY_RANK_FULL_STATE = StateDictOptions(full_state_dict=True)  # gathered to every rank, on its device
LOAD_FULL_STATE = StateDictOptions(full_state_dict=True)
DRAFT_PREFIX = "draft."


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.collective_device)
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

    @property
    def collective_device(self) -> torch.device:
        """nccl reduces CUDA tensors only; gloo CPU tensors."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def process_group_options(device: torch.device, timeout_s: float) -> dict[str, Any]:
    """init_process_group's arguments: gloo on CPU, nccl on GPU, and how long a collective may wait for a rank
    (`training.collective_timeout_s`; NCCL's watchdog otherwise ends a job after its default of 10 minutes)."""
    return {"backend": "nccl" if device.type == "cuda" else "gloo", "timeout": timedelta(seconds=timeout_s)}


def setup_distributed(device: torch.device, timeout_s: float) -> Distributed:
    """One process (no process group), or a torchrun rank: gloo on CPU, nccl on GPU (one GPU per rank)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Distributed(device=device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(**process_group_options(device, timeout_s))
    return Distributed(rank=dist.get_rank(), world_size=world, device=device)


def leave_process_group(env: Distributed) -> None:
    """Destroy the process group (once: a rank that already left it calls this again on its way out)."""
    if env.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def parallelise(module: nn.Module, strategy: str, env: Distributed) -> nn.Module:
    """The module the step loop calls: as is (one rank), DDP-wrapped, or fully sharded in place."""
    if strategy not in STRATEGIES:
        raise ValueError(f"deployment.trainer.strategy {strategy!r}: expected one of {STRATEGIES}")
    if env.world_size == 1:
        return module
    if strategy == "ddp":
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(module, device_ids=device_ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    fully_shard(module, mesh=mesh)
    return module


@contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulated step."""
    if enabled:
        yield
        return
    if isinstance(module, nn.parallel.DistributedDataParallel):
        with module.no_sync():
            yield
        return
    if hasattr(module, "set_requires_gradient_sync"):  # an FSDP2 module
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
        return
    yield  # one rank: nothing to synchronise


def full_draft_weights(module: nn.Module, every_rank: bool = False) -> dict[str, torch.Tensor]:
    """The draft's full weights, keyed as in the draft (collective under FSDP; every rank calls it). Under FSDP
    only rank 0 receives them, on CPU, and the other ranks an empty dict; `every_rank`: each rank receives them
    on its device (the sharded evaluation needs the whole draft everywhere)."""
    weights = get_model_state_dict(module, options=EVERY_RANK_FULL_STATE if every_rank else FULL_STATE)
    return {name.removeprefix(DRAFT_PREFIX): value for name, value in weights.items()}


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """AdamW state keyed by parameter name, full and on CPU (collective under FSDP)."""
    return get_optimizer_state_dict(module, optimizer, options=FULL_STATE)


def load_full_state(module: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                    optimizer_state: dict[str, Any]) -> None:
    """Put full weights and optimizer state (as saved by the two functions above) into the possibly sharded
    module and its optimizer; every rank reads the files and calls this."""
    set_model_state_dict(module, {DRAFT_PREFIX + name: value for name, value in weights.items()},
                         options=LOAD_FULL_STATE)
    set_optimizer_state_dict(module, optimizer, optimizer_state, options=LOAD_FULL_STATE)
