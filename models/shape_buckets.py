"""Sizes rounded up to a bucket, so that the shapes of a training run's matmuls repeat from batch to batch.

oneDNN builds (JIT-compiles) its bf16 kernels for AMX / AVX512-BF16 per matrix shape and caches them; a batch whose
shapes were seen before reuses them. Records have every length, so without buckets nearly every step meets new
shapes: measured on the embedded default's features (bf16, 2 threads, AMX host), 12 batches of new shapes trained at
1,344 tokens/s and the same 12 again at 1,702. fp32 kernels are not built per shape (975 vs 1,007). Padding costs
what the padded rows compute (~16 rows per batch and per step's supervised rows under a bucket of 32); on the same
features 12 batches trained at 1,469 tokens/s on first sight with buckets of 32 (1,648 on the second pass), buckets
of 16 and 128 were no better.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: The multiple that batch lengths, teacher chunks and supervised row counts are rounded up to in bf16/fp16.
SHAPE_BUCKET = 32


def shape_bucket(dtype: torch.dtype) -> int:
    """The bucket for kernels computing in `dtype`: fp32 kernels are not built per shape, so fp32 pads nothing
    (there padding only costs: 975 -> 823 tokens/s with a bucket of 64)."""
    return 1 if dtype == torch.float32 else SHAPE_BUCKET


def bucketed(size: int, bucket: int) -> int:
    """`size` rounded up to a multiple of `bucket` (0 stays 0)."""
    return -(-size // bucket) * bucket


def pad_rows(rows: torch.Tensor, bucket: int) -> torch.Tensor:
    """[n, ...] -> [bucketed(n), ...] with zero rows after the n given (the caller keeps the first n results)."""
    missing = bucketed(rows.shape[0], bucket) - rows.shape[0]
    if not missing:
        return rows
    return F.pad(rows, (0, 0) * (rows.dim() - 1) + (0, missing))
