"""A candidate against the champion on the same prompts, one eval set at a time, with paired bootstrap intervals.

The gates must tell a real step back from the noise of a few dozen prompts: τ moves by a few hundredths between two
drafters trained alike. So each eval set (the reference prompts, and each suite of `evaluation.sets`) is compared
prompt by prompt: rows pair on the prompt's name and the hash of the token ids it decoded (the reference prompts on
their names alone, which the registry's eval fingerprint vouches for), the paired bootstrap
(tasks/common/intervals.py) resamples the same prompts for both versions, and the difference's interval says
whether the change is outside the noise. A set the champion measured on other prompts or other decode settings is
not comparable, and says why. No I/O: tasks/register.py reads the champion's report and tasks/registry/gates.py
turns these into gates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from contract.reports import AcceptanceReport, BenchmarkReport, ModeAcceptance, PromptAcceptance, PromptTokens
from tasks.common.intervals import (Interval, PromptRounds, generated_rounds, paired_difference, pooled_tau,
                                    prompt_rounds)

#: The set of the reference prompts (the chain every version decodes, greedy equivalence included).
REFERENCE = "reference"


@dataclass(frozen=True)
class SetComparison:
    """One eval set measured by both versions on the same prompts: both pooled τ and the paired difference."""

    name: str
    candidate: float
    champion: float
    difference: Interval  # τ(candidate) − τ(champion), paired bootstrap over the set's prompts
    candidate_rounds: tuple[PromptRounds, ...] = ()  # the paired prompts, in the same order: to redo the interval
    champion_rounds: tuple[PromptRounds, ...] = ()

    @property
    def significant_drop(self) -> bool:
        return self.difference.high < 0.0

    @property
    def significant_gain(self) -> bool:
        return self.difference.low > 0.0

    def difference_at(self, level: float, resamples: int) -> Interval:
        """The paired difference's interval at another confidence level: the improvement gate widens it to correct
        for the several sets it reads."""
        return paired_difference(self.candidate_rounds, self.champion_rounds, level, resamples)

    def describe(self, difference: Optional[Interval] = None) -> str:
        """One line: both τ and the difference with its interval (`difference`: another level's, else the 95 %)."""
        difference = difference or self.difference
        return (f"{self.name}: {self.candidate:.3f} vs champion {self.champion:.3f}, difference "
                f"{difference.estimate:+.3f} [{difference.low:+.3f}, {difference.high:+.3f}] over "
                f"{difference.prompts} prompt{'s' if difference.prompts != 1 else ''}")


@dataclass(frozen=True)
class Incomparable:
    """An eval set the two versions did not measure alike, and why."""

    name: str
    reason: str


Comparison = Union[SetComparison, Incomparable]

#: A prompt's (or unit's) row: rounds with accepted tokens per position, or rounds with tokens (SGLang's suites).
PromptRow = Union[PromptAcceptance, PromptTokens]


@dataclass(frozen=True)
class SuiteRounds:
    """A version's suites as measured: by whom and how (two versions pair only when all of it is equal), and each
    suite's per-unit rows."""

    measured_by: str
    steps: int
    max_new_tokens: int
    temperature: float
    unit: str
    rows: dict[str, list[PromptRow]]

    def settings(self) -> dict[str, Any]:
        return {"measured by": self.measured_by, "evaluation.steps": self.steps,
                "evaluation.max_new_tokens": self.max_new_tokens, "evaluation.temperature": self.temperature,
                "unit": self.unit}


def by_suite(rows: list[PromptRow]) -> dict[str, list[PromptRow]]:
    """Rows grouped by suite (their `source`), in report order."""
    grouped: dict[str, list[PromptRow]] = {}
    for row in rows:
        grouped.setdefault(row.source or "unnamed", []).append(row)
    return grouped


def measured_suites(acceptance: AcceptanceReport, serving: Optional[BenchmarkReport]) -> Optional[SuiteRounds]:
    """The suites where the run measured them: replayed on an engine (`evaluation.sets_on: engine`, the benchmark
    report), else decoded offline (the evaluate report); None without suites."""
    engines = serving.engines if serving is not None else {}
    for kind, engine in sorted(engines.items()):
        suites = engine.suites
        if suites is not None:
            return SuiteRounds(f"{kind} engine", suites.steps, suites.max_new_tokens, suites.temperature, suites.unit,
                               by_suite(suites.per_prompt))
    if acceptance.suites is None:
        return None
    return SuiteRounds("offline decoder", acceptance.suites.steps, acceptance.max_new_tokens, acceptance.temperature,
                       "prompts", by_suite(acceptance.suites.per_prompt))


def rounds_of(row: PromptRow) -> PromptRounds:
    """A row's share of τ: its accepted tokens per position, or (SGLang) the tokens its rounds emitted."""
    if isinstance(row, PromptTokens):
        return generated_rounds(row.rounds, row.generated_tokens)
    return prompt_rounds(row.rounds, row.accepted_per_position)


def settings_difference(candidate: AcceptanceReport, champion: AcceptanceReport,
                        candidate_mode: ModeAcceptance, champion_mode: ModeAcceptance) -> Optional[str]:
    """Why two reports' decodes are not alike (steps, budget, temperature), None when they are."""
    pairs = {"evaluation.steps": (candidate_mode.steps, champion_mode.steps),
             "evaluation.max_new_tokens": (candidate.max_new_tokens, champion.max_new_tokens),
             "evaluation.temperature": (candidate.temperature, champion.temperature)}
    differing = [f"{name} {ours} vs {theirs}" for name, (ours, theirs) in pairs.items() if ours != theirs]
    return f"decoded with other settings ({', '.join(differing)})" if differing else None


def compare_rows(name: str, candidate: list[PromptRow], champion: list[PromptRow],
                 on_names: bool = False) -> Comparison:
    """The paired comparison when both versions decoded exactly the same prompts: same names and token hashes, or
    names alone when `on_names` (something else vouches for the tokens)."""
    if not on_names and any(row.input_hash is None for row in champion):
        return Incomparable(name, "the champion's rows carry no prompt hashes (evaluated before eaglet recorded them)")

    def key(row: PromptRow) -> tuple[str, Optional[str]]:
        return (row.prompt, None if on_names else row.input_hash)

    theirs = {key(row): row for row in champion}
    ours = [key(row) for row in candidate]
    if set(ours) != set(theirs) or len(set(ours)) != len(candidate) or len(theirs) != len(champion):
        shared = len(set(ours) & set(theirs))
        return Incomparable(name, f"measured on other prompts ({shared} of the candidate's {len(candidate)} prompts "
                                  f"and the champion's {len(champion)} are the same)")
    mine = [rounds_of(row) for row in candidate]
    paired = [rounds_of(theirs[pair]) for pair in ours]
    return SetComparison(name, pooled_tau(mine), pooled_tau(paired), paired_difference(mine, paired), tuple(mine),
                         tuple(paired))


def compare_reference(candidate: AcceptanceReport, champion: AcceptanceReport) -> Comparison:
    """The reference prompts' chain, paired on prompt names: the registry's eval fingerprint (checked first, by the
    gate) vouches that both versions read the same prompts. Their token hashes cannot: a later turn's prompt holds
    the earlier turns' replies, which each run regenerates and a GPU does not reproduce."""
    differing = settings_difference(candidate, champion, candidate.chain, champion.chain)
    if differing:
        return Incomparable(REFERENCE, differing)
    return compare_rows(REFERENCE, candidate.chain.per_prompt, champion.chain.per_prompt, on_names=True)


def compare_suites(candidate: Optional[SuiteRounds], champion: Optional[SuiteRounds]) -> dict[str, Comparison]:
    """Each of the candidate's suites against the champion's suite of the same name, measured alike."""
    if candidate is None:
        return {}
    comparisons: dict[str, Comparison] = {}
    for name, rows in candidate.rows.items():
        if champion is None or name not in champion.rows:
            comparisons[name] = Incomparable(name, "the champion was not evaluated on this suite")
            continue
        ours, theirs = candidate.settings(), champion.settings()
        differing = [f"{key} {ours[key]} vs {theirs[key]}" for key in ours if ours[key] != theirs[key]]
        if differing:
            comparisons[name] = Incomparable(name, f"measured otherwise ({', '.join(differing)})")
        else:
            comparisons[name] = compare_rows(name, rows, champion.rows[name])
    return comparisons
