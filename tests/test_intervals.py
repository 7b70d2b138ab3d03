"""Bootstrap intervals of τ over prompts (tasks/common/intervals.py): what they estimate, that they cover, and that
a paired comparison sees a difference that two separate intervals cannot."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.common.intervals import (PromptRounds, paired_difference, pooled_tau, prompt_rounds, tau_interval)


def prompts_from(taus: list[float], rounds: int = 20) -> list[PromptRounds]:
    return [PromptRounds(tau * rounds, float(rounds)) for tau in taus]


def test_a_prompts_rounds_come_from_its_per_position_counts() -> None:
    # 10 rounds; 6 accepted position 1, 2 of those position 2: 10 bonus tokens + 8 drafts
    assert prompt_rounds(10, [6, 2]) == PromptRounds(18.0, 10.0)


def test_tau_pools_rounds_and_the_interval_holds_it() -> None:
    prompts = [PromptRounds(30.0, 20.0), PromptRounds(12.0, 10.0), PromptRounds(50.0, 25.0), PromptRounds(8.0, 8.0)]
    interval = tau_interval(prompts)
    assert interval.estimate == pytest.approx(100.0 / 63.0)
    assert interval.low < interval.estimate < interval.high and interval.prompts == 4
    assert tau_interval(prompts) == interval, "seeded: the same prompts give the same interval"
    assert tau_interval([PromptRounds(12, 10), PromptRounds(9, 9)]).estimate == pytest.approx(21 / 19), "ints"
    one = tau_interval(prompts[:1])
    assert one.low == one.high == one.estimate == 1.5


def test_the_interval_narrows_with_more_prompts() -> None:
    generator = np.random.default_rng(3)
    few = prompts_from(list(1.0 + generator.gamma(2.0, 0.15, size=8)))
    many = prompts_from(list(1.0 + generator.gamma(2.0, 0.15, size=128)))
    assert (tau_interval(many).high - tau_interval(many).low) < (tau_interval(few).high - tau_interval(few).low) / 2


def test_the_95_percent_interval_covers_the_true_tau_about_95_times_in_100() -> None:
    """Prompts drawn from a known population (τ per prompt 1 + Gamma, rounds 5..40): over 200 draws of 32 prompts
    the interval holds the population's pooled τ about as often as it says."""
    generator = np.random.default_rng(11)
    population_tau = 1.0 + generator.gamma(2.0, 0.15, size=20000)
    population_rounds = generator.integers(5, 41, size=20000)
    truth = float((population_tau * population_rounds).sum() / population_rounds.sum())
    covered = 0
    for _ in range(200):
        chosen = generator.integers(0, 20000, size=32)
        prompts = [PromptRounds(float(population_tau[i] * population_rounds[i]), float(population_rounds[i]))
                   for i in chosen]
        interval = tau_interval(prompts, resamples=1000)
        covered += interval.low <= truth <= interval.high
    assert 0.88 <= covered / 200 <= 0.99, f"covered {covered} of 200"


def test_a_paired_difference_sees_what_two_intervals_cannot() -> None:
    """Prompts differ far more among themselves than the candidate differs from the baseline on each of them: the
    separate intervals overlap, the paired interval excludes zero."""
    generator = np.random.default_rng(5)
    baseline_taus = list(1.0 + generator.gamma(2.0, 0.3, size=40))
    baseline = prompts_from(baseline_taus)
    candidate = prompts_from([tau + 0.03 for tau in baseline_taus])
    separate = tau_interval(candidate), tau_interval(baseline)
    assert separate[0].low < separate[1].high, "the separate intervals overlap"
    difference = paired_difference(candidate, baseline)
    assert difference.estimate == pytest.approx(0.03) and difference.low > 0.0
    same = paired_difference(baseline, baseline)
    assert same.estimate == same.low == same.high == 0.0
    assert pooled_tau(candidate) - pooled_tau(baseline) == pytest.approx(difference.estimate)
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference(candidate[:3], baseline)
