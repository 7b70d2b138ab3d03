"""Greedy equivalence as strict as the dtype that computed the outputs can hold it.

In float32 speculative decoding reproduces the target's greedy output token for token, so any difference is a bug
and fails (`GreedyRule.exact`). In bfloat16 or float16 a verify forward over several tokens, another batch or another
kernel rounds differently, and where the target's two best tokens are closer than that rounding the argmax can flip:
a divergence there is numerics, not a broken decoder. So a 16-bit output that differs is judged at its first differing
token by the target's top-2 logit gap there (`TargetMargins`): one forward of the target over the prompt and the
shared prefix, in float32. float32 because the gap must not carry the very rounding being judged, and a 16-bit
checkpoint's weights are exact in float32, so upcasting changes nothing else; it costs one forward per diverging
output, and none when every output agrees. A gap below `evaluation.greedy_near_tie_margin` is a near-tie. The rule
fails on any divergence that is not a near-tie, and on more diverging outputs than
`evaluation.max_greedy_mismatch_rate` of those compared (a planted decoder bug changes nearly every output, and a
random or under-trained target has near-ties everywhere).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from contract.config import EvaluationConfig

#: The names a float32 dtype goes by: on torch (`torch.float32`), in a config and on an engine's --dtype flag.
FLOAT32_NAMES = frozenset({"float32", "float", "fp32"})

Describe = Callable[[dict[str, Any]], str]


@dataclass(frozen=True)
class GreedyRule:
    """What a greedy comparison computed in `dtype` must show: identity in float32, near-ties only otherwise."""

    dtype: str
    near_tie_margin: float
    max_mismatch_rate: float

    @property
    def exact(self) -> bool:
        return self.dtype in FLOAT32_NAMES

    def near_tie(self, margin: float) -> bool:
        return margin < self.near_tie_margin

    def summary(self, divergences: list[dict[str, Any]], compared: int) -> dict[str, Any]:
        """The rule and what it was applied to, as the reports carry it."""
        return {"dtype": self.dtype, "exact": self.exact, "near_tie_margin": self.near_tie_margin,
                "max_mismatch_rate": self.max_mismatch_rate, "compared": compared, "diverged": len(divergences),
                "mismatch_rate": len(divergences) / compared if compared else 0.0,
                "near_ties": sum(bool(row.get("near_tie")) for row in divergences)}


def greedy_rule(dtype: str, settings: EvaluationConfig) -> GreedyRule:
    """The rule for outputs computed in `dtype`, with the run's tolerances."""
    return GreedyRule(dtype, settings.greedy_near_tie_margin, settings.max_greedy_mismatch_rate)


def model_dtype(model: Any) -> str:
    """The dtype a loaded model computes in, as its config would name it ('bfloat16')."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def served_dtype(command: Sequence[str]) -> str:
    """The dtype an engine command line serves in: its last --dtype (argparse keeps the last), 'auto' without one,
    which vLLM and SGLang both resolve to a 16-bit dtype for a float32 checkpoint."""
    served = "auto"
    for index, part in enumerate(command):
        if part == "--dtype" and index + 1 < len(command):
            served = command[index + 1]
        elif part.startswith("--dtype="):
            served = part.removeprefix("--dtype=")
    return served


def first_difference(left: Sequence[Any], right: Sequence[Any]) -> int:
    """The first index where two token or character sequences differ (the shorter's length when one extends the
    other)."""
    for position, (a, b) in enumerate(zip(left, right)):
        if a != b:
            return position
    return min(len(left), len(right))


def top2_gap(model: Any, ids: Sequence[int]) -> float:
    """The target's top-1 minus top-2 logit for the token after `ids` (the same gap in log-probabilities)."""
    import torch

    if not ids:
        raise ValueError("a top-2 gap needs at least one token of context")
    tensor = torch.tensor([list(ids)], device=next(model.parameters()).device)
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with torch.inference_mode():
        logits = model(input_ids=tensor, **last_only).logits[0, -1].float()
    best = logits.topk(2).values
    return float(best[0] - best[1])


def in_float32(model: Any) -> Any:
    """The model in float32: itself when it is, else converted in place (exact from 16-bit weights). The caller's
    last use of it in its own dtype: every later forward, the drafter's shared embedding included, is float32."""
    return model if model_dtype(model) == "float32" else model.float()


class TargetMargins:
    """Top-2 gaps of the target in float32, from a model `load` returns the first time a gap is asked for: outputs
    that all agree cost no load."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load
        self._model: Optional[Any] = None

    def gap(self, ids: Sequence[int]) -> float:
        if self._model is None:
            self._model = in_float32(self._load())
        return top2_gap(self._model, ids)


def judged(row: dict[str, Any], margin: float, rule: GreedyRule) -> dict[str, Any]:
    """A divergence row with the target's gap at its first differing token and whether that is a near-tie."""
    return {**row, "margin": margin, "near_tie": rule.near_tie(margin)}


def near_tie_failures(divergences: list[dict[str, Any]], compared: int, rule: GreedyRule,
                      describe: Describe) -> list[str]:
    """What fails the 16-bit rule: each divergence that is not a near-tie (named by `describe`), and a mismatch rate
    above the threshold. None when the outputs pass it."""
    failures = []
    wide = [row for row in divergences if not row["near_tie"]]
    if wide:
        listed = ", ".join(f"{describe(row)}: top-2 logit gap {row['margin']:.3g}" for row in wide[:10])
        failures.append(f"{len(wide)} greedy output(s) computed in {rule.dtype} diverge where the target is not at a "
                        f"near-tie (gap >= evaluation.greedy_near_tie_margin {rule.near_tie_margin:g}): {listed}")
    rate = len(divergences) / compared if compared else 0.0
    if rate > rule.max_mismatch_rate:
        failures.append(f"{len(divergences)} of {compared} greedy outputs computed in {rule.dtype} diverge "
                        f"({rate:.1%}), above evaluation.max_greedy_mismatch_rate {rule.max_mismatch_rate:.1%}")
    return failures
