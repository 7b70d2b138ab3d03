"""Bootstrap intervals for acceptance length over prompts: how far a τ measured on a few dozen prompts can be trusted.

τ (mean accepted length per verify round) pools rounds over prompts: Σ tokens accepted / Σ rounds. Prompts, not
rounds, are the independent draws (rounds of one prompt share its topic and its draft's luck), so the interval
resamples whole prompts with replacement and recomputes the pooled ratio each time; its bounds are the 2.5th and
97.5th percentiles of those ratios (the percentile bootstrap). Two drafters measured on the same prompts are compared
by a paired bootstrap: the same resampled prompts for both, so the prompts' shared difficulty cancels out of the
difference.

The resampling is seeded: the same prompts give the same interval in every run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

#: Resamples per interval: the bounds move by well under 0.01 in τ between seeds at this count.
RESAMPLES = 4000
LEVEL = 0.95
SEED = 0


@dataclass(frozen=True)
class PromptRounds:
    """One prompt's share of a pooled τ: the tokens its rounds accepted (bonus token included) and its rounds."""

    accepted: float
    rounds: float


@dataclass(frozen=True)
class Interval:
    """A pooled estimate with its bootstrap interval over prompts."""

    estimate: float
    low: float
    high: float
    prompts: int

    def as_json(self) -> dict[str, float]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "prompts": self.prompts}

    def describe(self) -> str:
        return f"{self.estimate:.3f} [{self.low:.3f}-{self.high:.3f}]"


def prompt_rounds(rounds: int, accepted_per_position: Sequence[float]) -> PromptRounds:
    """A prompt's rounds from the report's per-prompt counts: each round emits its bonus token plus the draft tokens
    it accepted, and `accepted_per_position[d]` counts the rounds that accepted position d + 1."""
    return PromptRounds(float(rounds) + float(sum(accepted_per_position)), float(rounds))


def round_tokens(emitted: int) -> int:
    """Tokens emitted by verify rounds: all a request emitted but the prefill's first token (that one comes from the
    prompt's forward, not from a round)."""
    return max(emitted - 1, 0)


def generated_rounds(rounds: int, generated_tokens: int) -> PromptRounds:
    """A prompt's rounds from what an engine without per-position counts reports per request (SGLang's /generate):
    its verify rounds and every token it emitted, the prefill's included."""
    return PromptRounds(float(round_tokens(generated_tokens)), float(rounds))


def pooled_tau(prompts: Sequence[PromptRounds]) -> float:
    rounds = sum(prompt.rounds for prompt in prompts)
    return sum(prompt.accepted for prompt in prompts) / rounds if rounds else 0.0


def resampled_indices(count: int, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """[resamples, count] prompt indices drawn with replacement (one row per bootstrap sample)."""
    return np.random.default_rng(seed).integers(0, count, size=(resamples, count))


def ratio_samples(prompts: Sequence[PromptRounds], indices: np.ndarray) -> np.ndarray:
    """The pooled τ of each bootstrap sample (a sample without a single round reads 0)."""
    accepted = np.array([prompt.accepted for prompt in prompts], dtype=np.float64)[indices].sum(axis=1)
    rounds = np.array([prompt.rounds for prompt in prompts], dtype=np.float64)[indices].sum(axis=1)
    return np.divide(accepted, rounds, out=np.zeros_like(accepted), where=rounds > 0)


def percentile_bounds(samples: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(samples, [tail, 100.0 - tail])
    return float(low), float(high)


def tau_interval(prompts: Sequence[PromptRounds], level: float = LEVEL, resamples: int = RESAMPLES) -> Interval:
    """Pooled τ of `prompts` with its percentile-bootstrap interval over prompts."""
    estimate = pooled_tau(prompts)
    if len(prompts) < 2:
        return Interval(estimate, estimate, estimate, len(prompts))
    low, high = percentile_bounds(ratio_samples(prompts, resampled_indices(len(prompts), resamples)), level)
    return Interval(estimate, low, high, len(prompts))


def paired_difference(candidate: Sequence[PromptRounds], baseline: Sequence[PromptRounds], level: float = LEVEL,
                      resamples: int = RESAMPLES) -> Interval:
    """τ(candidate) − τ(baseline) over the same prompts, in the same order, with its paired bootstrap interval."""
    if len(candidate) != len(baseline):
        raise ValueError(f"a paired comparison needs the same prompts: {len(candidate)} against {len(baseline)}")
    estimate = pooled_tau(candidate) - pooled_tau(baseline)
    if len(candidate) < 2:
        return Interval(estimate, estimate, estimate, len(candidate))
    indices = resampled_indices(len(candidate), resamples)
    low, high = percentile_bounds(ratio_samples(candidate, indices) - ratio_samples(baseline, indices), level)
    return Interval(estimate, low, high, len(candidate))
