"""Bugs planted in TargetState, the target forward that the speculative decoder's verify step runs.

Each is the same wrong computation for a verify tree as for a one-token step, so a greedy baseline decoded
through TargetState (as the evaluate stage's once was) agrees with the broken speculative decoder and passes it;
only a reference that shares none of this code (HF `generate`) can see it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import pytest
import torch

from models.speculative import TargetState, prefill


def scale_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every token rotated at four times its position: a RoPE position bug (a constant shift would change
    nothing, and this tiny random target seldom notices a factor of 2)."""
    forward = TargetState.forward

    def scaled(self: TargetState, tokens: Sequence[int], positions: torch.Tensor,
               visible: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return forward(self, tokens, positions * 4, visible)

    monkeypatch.setattr(TargetState, "forward", scaled)


def hide_first_cached_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens after the prefill no longer see the first token's key: a prefix-mask bug."""
    attention_mask = TargetState.attention_mask

    def without_first_key(self: TargetState, visible: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        mask = attention_mask(self, visible, positions)
        if self.length:
            mask[..., 0] = torch.finfo(mask.dtype).min
        return mask

    monkeypatch.setattr(TargetState, "attention_mask", without_first_key)


BUGS: list[Callable[[pytest.MonkeyPatch], None]] = [scale_positions, hide_first_cached_key]


def cached_greedy_decode(model: Any, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """The old greedy baseline: one token per TargetState forward, through the speculative decoder's own cache
    and 4D-mask code (so it shares every bug above)."""
    with torch.inference_mode():
        state = TargetState(model)
        logits, _ = prefill(state, prompt_ids)
        tokens = [int(logits[-1].argmax())]
        while len(tokens) < max_new_tokens:
            logits, _ = state.forward(tokens[-1:], torch.tensor([state.length]), torch.ones(1, 1, dtype=torch.bool))
            tokens.append(int(logits[-1].argmax()))
    return tokens
