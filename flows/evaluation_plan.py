"""How much decoding a config's evaluation asks for, and about how long it takes, before anything runs.

A GPU recipe that leaves `evaluation.max_prompts` unset decodes every held-out record (thousands, at 2 % of a large
corpus) three times at `evaluation.max_new_tokens`, one prompt at a time, and the agreement check replays them again:
days before anything is registered. `eaglet config validate` prints this plan so that the size is seen on paper.

Counts are upper bounds read from the config alone (no data is read): a source's held-out records are its `limit`
(split eval) or `eval_fraction` of it (split auto), unbounded without a limit; a record yields one prompt per user
turn, `max_user_turns` of them where the source caps it (one where it does not: said as "at least"). The time is
the decoded tokens at `evaluation.expected_tokens_per_s`, or at the rate this output directory's last evaluate report
measured for the target alone; a speculative decode is counted as slow as the target alone (an upper bound where
the drafter pays).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from contract.config import DataSource, RunConfig

#: The evaluate stage's report, whose `target.tokens_per_second` is a measured decode rate for this run's target.
LAST_ACCEPTANCE = Path("evaluate") / "acceptance.json"


@dataclass(frozen=True)
class Bound:
    """A count that is at most `value` (None: unbounded), exact when no source left its turns uncapped."""

    value: Optional[int]
    at_least: bool = False

    def __add__(self, other: "Bound") -> "Bound":
        if self.value is None or other.value is None:
            return Bound(None)
        return Bound(self.value + other.value, self.at_least or other.at_least)

    def describe(self) -> str:
        if self.value is None:
            return "unbounded"
        return f"{'≥ ' if self.at_least else ''}{self.value:,}"


@dataclass(frozen=True)
class PlanItem:
    """One part of the evaluation: its prompts, the decodes of `max_new_tokens` each, and who decodes them."""

    name: str
    prompts: Bound
    decodes: int
    where: str

    def tokens(self, max_new_tokens: int) -> Bound:
        if self.prompts.value is None:
            return Bound(None)
        return Bound(self.prompts.value * self.decodes * max_new_tokens, self.prompts.at_least)


@dataclass(frozen=True)
class EvaluationPlan:
    """The evaluation's parts, the trainer's eval records, and the offline decode rate the estimate uses."""

    items: list[PlanItem]
    max_new_tokens: int
    trainer_eval_records: Bound
    tokens_per_second: Optional[float]
    rate_origin: str

    def offline_tokens(self) -> Bound:
        total = Bound(0)
        for item in self.items:
            if item.where == "offline":
                total = total + item.tokens(self.max_new_tokens)
        return total

    def offline_seconds(self) -> Optional[float]:
        """The offline decodes' time at the plan's rate; None when unbounded or no rate is known."""
        tokens = self.offline_tokens().value
        if tokens is None or not self.tokens_per_second:
            return None
        return tokens / self.tokens_per_second

    def lines(self) -> list[str]:
        """The plan as `config validate` prints it."""
        out = [f"evaluation plan ({self.max_new_tokens} new tokens a decode):"]
        for item in self.items:
            out.append(f"  {item.name}: {item.prompts.describe()} prompts × {item.decodes} decode(s), {item.where} "
                       f"→ {item.tokens(self.max_new_tokens).describe()} tokens")
        out.append(f"  trainer's eval: {self.trainer_eval_records.describe()} held-out records (capture.eval_records)")
        out.append(f"  offline decoding: {self.offline_tokens().describe()} tokens, {self.estimate_text()}")
        return out

    def estimate_text(self) -> str:
        seconds = self.offline_seconds()
        if self.offline_tokens().value is None:
            return "no estimate: set evaluation.max_prompts and each suite's records (or the sources' limit)"
        if seconds is None:
            return "no estimate: set evaluation.expected_tokens_per_s (the target's decode rate on its device)"
        return f"about {format_duration(seconds)} at {self.tokens_per_second:,.0f} tok/s ({self.rate_origin})"


def format_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{math.ceil(seconds)} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def source_prompts(source: DataSource, eval_fraction: float) -> Bound:
    """The held-out prompts one source can give: records held out times the user turns each can have."""
    records = held_out_records(source, eval_fraction).value
    if records is None or records == 0:
        return Bound(records)
    if source.max_user_turns is None:
        return Bound(records, at_least=True)
    return Bound(records * source.max_user_turns)


def prompts_of(cfg: RunConfig, names: Optional[Sequence[str]], records: Optional[int]) -> Bound:
    """Prompts of the held-out records of the named sources (all when None), at most `records` records."""
    chosen = [source for source in cfg.data.sources if names is None or source.name in names]
    available = Bound(0)
    for source in chosen:
        available = available + source_prompts(source, cfg.validation.eval_fraction)
    if records is None:
        return available
    turns = max((source.max_user_turns or 1 for source in chosen), default=1)
    capped = records * turns
    if available.value is not None and available.value <= capped:
        return available
    return Bound(capped, at_least=any(source.max_user_turns is None for source in chosen))


def decode_rate(cfg: RunConfig) -> tuple[Optional[float], str]:
    """The target's decode rate for the estimate: configured, else measured by this output dir's last evaluate."""
    from tasks.common.artifacts import read_json

    if cfg.evaluation.expected_tokens_per_s is not None:
        return cfg.evaluation.expected_tokens_per_s, "evaluation.expected_tokens_per_s"
    path = cfg.output_path / LAST_ACCEPTANCE
    if path.is_file():
        rate = float(((read_json(path).get("target") or {}).get("tokens_per_second")) or 0.0)
        if rate > 0:
            return rate, f"measured by {path}"
    return None, "unknown"


def evaluation_plan(cfg: RunConfig) -> EvaluationPlan:
    """The plan of `cfg`'s evaluation: reference prompts, suites, agreement replay, trainer's eval."""
    settings = cfg.evaluation
    modes = 2 if settings.topk > 1 else 1  # the chain, and the tree when topk > 1
    reference = prompts_of(cfg, settings.sources, settings.max_prompts)
    items = [PlanItem("reference prompts (target alone, chain" + (", tree)" if modes == 2 else ")"), reference,
                      1 + modes, "offline")]
    suites_where = "offline" if settings.sets_on == "offline" else "engine (benchmark)"
    for item in settings.sets:
        items.append(PlanItem(f"suite {item.source}", prompts_of(cfg, [item.source], item.records), 1, suites_where))
    if cfg.benchmark.engines:
        items.append(PlanItem("agreement replay (reference prompts)", reference, 1, "engine (benchmark)"))
    trainer = Bound(cfg.capture.eval_records) if cfg.capture.eval_records is not None else Bound(0)
    if cfg.capture.eval_records is None:
        for source in cfg.data.sources:
            trainer = trainer + held_out_records(source, cfg.validation.eval_fraction)
    rate, origin = decode_rate(cfg)
    return EvaluationPlan(items, settings.max_new_tokens, trainer, rate, origin)


def held_out_records(source: DataSource, eval_fraction: float) -> Bound:
    """Records a source holds out (not prompts): what the trainer's eval reads when capture.eval_records is null."""
    if source.split == "train":
        return Bound(0)
    if source.limit is None:
        return Bound(None)
    return Bound(source.limit if source.split == "eval" else math.ceil(source.limit * eval_fraction))
