"""torch.compile of the TTT step's dense parts (`training.compile`); eager stays the default and the reference.

The step does not compile into one graph: every draft step picks its supervised rows with a boolean mask (a
data-dependent shape) and reads its metrics on the host. Its dense parts do, each called once per draft step: the
layer before attention (norms, concatenation, q/k/v projections, RoPE), the layer after it (o_proj, residuals,
MLP), the head (final norm, lm_head) and the loss (log-softmax and the teacher's cross-entropy). Inductor fuses
their element-wise work around the matmuls; attention stays one fused SDPA call. Batch lengths and supervised row
counts change from batch to batch, so the parts compile with dynamic shapes after the first recompile.

Measured by `benchmarks/ttt_throughput.py --compile` against eager on the same shapes in the same run: it pays
where kernel launches and memory traffic dominate (GPU), hardly on a 2-core CPU (docs/measurements.md).
"""

from __future__ import annotations

from typing import Callable

import torch

from models.eagle3 import Eagle3Draft
from models.ttt import step_loss

#: the draft's methods ttt_forward calls once per draft step
COMPILED_PARTS = ("project_qkv", "finish", "logits")


def compile_draft_parts(draft: Eagle3Draft) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Replace the draft's per-step dense methods on this instance by compiled ones (its parameters, buffers and
    state dict are untouched) and return the compiled loss for `ttt_forward(loss_fn=...)`."""
    for name in COMPILED_PARTS:
        object.__setattr__(draft, name, torch.compile(getattr(draft, name)))
    return torch.compile(step_loss)
