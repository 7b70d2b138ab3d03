"""Where a stage runs its torch work (`runtime.device`) and in which precision the trainer computes."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager

import torch

from tasks.common.host_compute import host_compute


def resolve_device(setting: str) -> torch.device:
    """`auto` takes the GPU when one is visible; `cuda` without one is a configuration error."""
    if setting == "cuda" and not torch.cuda.is_available():
        raise ValueError("runtime.device is 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 autocast on GPU and on CPUs with bf16 matrix units (AMX, AVX512-BF16: several times fp32's
    rate); fp32 on other CPUs, where bf16 matmuls are emulated and slower than fp32 (tasks/common/host_compute.py)."""
    if precision == "bf16":
        return torch.bfloat16
    if precision == "auto" and (device.type == "cuda" or host_compute().native_bf16_matmul):
        return torch.bfloat16
    return torch.float32


def serving_dtype(setting: str, model_dtype: str, device: torch.device) -> str:
    """The dtype a target runs in to write replies (`regeneration.dtype`). `auto`: the checkpoint's own dtype
    unless that is float32, which then runs in bfloat16 on GPU and on CPUs with bf16 matrix units (vLLM's CPU build
    regenerates ~2.3x faster in bf16 on AMX: benchmarks/regenerate_dtypes.py) and in float32 elsewhere."""
    if setting != "auto":
        return setting
    if model_dtype != "float32":
        return model_dtype
    if device.type == "cuda" or host_compute().native_bf16_matmul:
        return "bfloat16"
    return "float32"


def autocast(device: torch.device, dtype: torch.dtype) -> ContextManager[Any]:
    """bf16 autocast around forward passes; the parameters and AdamW state stay fp32 (master weights), and
    the loss is computed in fp32 (models/ttt.step_loss). No grad scaler: bf16 has fp32's exponent range."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def release_device_memory() -> int:
    """Give what an in-process stage left behind back to the device: collect its cycles, then return the CUDA
    caching allocator's free blocks to the driver. The engine the next stage starts is another process and sees only
    what the driver has free: without this an evaluated 8B target's ~16 GB stays reserved beside SGLang's
    `--mem-fraction-static`. Returns the bytes returned to the driver (0 on CPU)."""
    import gc

    gc.collect()
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return reserved - torch.cuda.memory_reserved()
