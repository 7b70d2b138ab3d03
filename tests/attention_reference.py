"""The TTT attention spelled out (one dense softmax over causal and diagonal keys) and the error bf16 allows
(shared by tests/test_ttt.py and the GPU checks in tests/test_train_modes.py)."""

from __future__ import annotations

import torch

# bf16 keeps 8 significant bits: one rounding moves a value by up to 2^-8 of it. The fused call returns three
# rounded quantities (the causal part and both softmax shares) and the merged result is rounded once more, so
# bf16 itself allows four roundings of the output's magnitude, 2^-6 (~1.6e-2). Measured on CPU: a plain bf16
# causal SDPA call ~3e-3, the merged attention ~4e-3; before the merge used the kernel's rounded peak and
# fp32 diagonal scores, 4e-2 to 8e-2.
BF16_TOLERANCE = 4 * 2.0 ** -8


def dense_causal_plus_diagonal(queries: torch.Tensor, keys0: torch.Tensor, values0: torch.Tensor,
                               diagonal_keys: list[torch.Tensor], diagonal_values: list[torch.Tensor]) -> torch.Tensor:
    """In fp32, autocast off: query t attends to the step-0 keys 0..t and to each diagonal key at t, through
    one softmax."""
    length, groups = queries.shape[2], queries.shape[1] // keys0.shape[1]
    keys = torch.cat([keys0] + diagonal_keys, dim=2).repeat_interleave(groups, 1).float()
    values = torch.cat([values0] + diagonal_values, dim=2).repeat_interleave(groups, 1).float()
    allowed = torch.zeros(length, (1 + len(diagonal_keys)) * length, dtype=torch.bool, device=queries.device)
    for t in range(length):
        allowed[t, : t + 1] = True
        allowed[t, [j * length + t for j in range(1, 1 + len(diagonal_keys))]] = True
    with torch.autocast(queries.device.type, enabled=False):
        scores = queries.float() @ keys.transpose(-1, -2) / queries.shape[-1] ** 0.5
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ values


def bf16_error(result: torch.Tensor, queries: torch.Tensor, keys0: torch.Tensor, values0: torch.Tensor,
               diagonal_keys: list[torch.Tensor], diagonal_values: list[torch.Tensor]) -> float:
    """Max error of `result` against the dense attention over the inputs rounded to bf16 (what a bf16 kernel
    sees), as a share of the output's magnitude."""
    def rounded(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(torch.bfloat16)

    reference = dense_causal_plus_diagonal(rounded(queries), rounded(keys0), rounded(values0),
                                           [rounded(key) for key in diagonal_keys],
                                           [rounded(value) for value in diagonal_values])
    return float((result.detach().float() - reference).abs().max() / reference.abs().max())


def assert_within_bf16(result: torch.Tensor, *inputs: torch.Tensor | list[torch.Tensor]) -> None:
    error = bf16_error(result, *inputs)
    assert error <= BF16_TOLERANCE, f"max error {error:.4f} of the output's magnitude; bf16 allows {BF16_TOLERANCE:.4f}"
