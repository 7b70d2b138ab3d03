"""The suites of `evaluation.sets` replayed on the serving engine: acceptance measured at engine speed, by the engine.

With `evaluation.sets_on: engine` the benchmark stage sends every suite prompt, as the token ids the evaluate stage
renders (tasks/data/held_out.py), to `/v1/completions` of the vLLM engine drafting the evaluation's chain, with the
evaluation's budget and temperature, and reads vLLM's speculative counters (drafts, accepted tokens per draft
position) before and after each unit. A unit is one prompt (`benchmark.suite_concurrency` 1: the interval resamples
prompts, exactly as the offline decoder's) or a group of N prompts of one suite and category sent together (N > 1:
the counters cannot tell the N apart, so the unit's rounds are their sum and the interval resamples groups, a
cluster bootstrap). Each unit's row has the shape of the offline report's per-prompt rows, so the registry pairs
two versions' units the same way (tasks/registry/comparison.py). The offline decoder still decodes the reference
prompts, the stratified subset the agreement check compares the engine with (tasks/serving/agreement.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from contract.hashing import hash_text
from contract.reports import EngineSuites
from tasks.common.intervals import PromptRounds, prompt_rounds
from tasks.common.progress import advance, progress_bar
from tasks.common.suite_summary import bucket_names, bucket_report, prompt_hash
from tasks.data.held_out import EvalPrompt
from tasks.serving.counted_completions import CountedMemo, complete_unit


@dataclass(frozen=True)
class ReplayUnit:
    """Prompts whose counters are read together: one prompt, or a group of one suite and category (`grouped`: the
    replay sends several at once, so even a group of one counts in its suite and category buckets alone)."""

    prompts: tuple[EvalPrompt, ...]
    grouped: bool = False

    @property
    def key(self) -> str:
        return "+".join(prompt.key for prompt in self.prompts)

    @property
    def source(self) -> str:
        return self.prompts[0].source

    @property
    def category(self) -> str:
        return self.prompts[0].category

    @property
    def input_hash(self) -> str:
        """The prompt's token hash, or for a group the hash of its prompts' hashes in order."""
        if len(self.prompts) == 1:
            return prompt_hash(self.prompts[0].input_ids)
        return hash_text(json.dumps([prompt_hash(prompt.input_ids) for prompt in self.prompts]))

    def buckets(self) -> list[str]:
        """Every bucket for a single prompt; a group shares only its suite and category."""
        if not self.grouped:
            prompt = self.prompts[0]
            return bucket_names(prompt.source, prompt.category, prompt.length_bucket, prompt.turn)
        return [f"source={self.source}", f"category={self.category}"]


def units_label(concurrency: int) -> str:
    """What the suites' intervals resample, as the report and plot name it."""
    return "prompts" if concurrency == 1 else f"groups of up to {concurrency} prompts"


def replay_units(prompts: Sequence[EvalPrompt], concurrency: int) -> list[ReplayUnit]:
    """The prompts in units of at most `concurrency`, never mixing suites or categories (suites and categories in
    the order they first appear, prompts in their order)."""
    groups: dict[tuple[str, str], list[EvalPrompt]] = {}
    for prompt in prompts:
        groups.setdefault((prompt.source, prompt.category), []).append(prompt)
    units = []
    for members in groups.values():
        for start in range(0, len(members), concurrency):
            units.append(ReplayUnit(tuple(members[start:start + concurrency]), grouped=concurrency > 1))
    return units


def replay_suites(engine: Any, kind: str, units: Sequence[ReplayUnit], max_tokens: int,
                  temperature: float, memo: Optional[CountedMemo] = None) -> dict[str, Any]:
    """Each unit's prompts on the engine, its counters read around them: {"rows": one per unit, "seconds"}. Single
    prompts go through `memo` when given, so a later agreement run reuses them."""
    rows = []
    started = time.perf_counter()
    with progress_bar(f"{kind}: suites on the engine", len(units)) as bar:
        for unit in units:
            counted = complete_unit(engine, kind, unit.prompts, max_tokens, temperature, memo)
            rows.append({"prompt": unit.key, "source": unit.source, "input_hash": unit.input_hash,
                         "rounds": int(round(counted.drafts)), "accepted_per_position": counted.accepted_per_position,
                         "generated_tokens": counted.completion_tokens})
            advance(bar, 1)
    return {"rows": rows, "seconds": time.perf_counter() - started}


def suites_summary(kind: str, replay: dict[str, Any], units: Sequence[ReplayUnit], steps: int, max_tokens: int,
                   temperature: float, concurrency: int) -> dict[str, Any]:
    """benchmark/report.json's `engines.<kind>.suites` (contract/reports.py's EngineSuites) from the replay's rows."""
    rows = replay["rows"]
    accepted = [sum(row["accepted_per_position"][position] for row in rows
                    if position < len(row["accepted_per_position"])) for position in range(steps)]
    rounds = sum(row["rounds"] for row in rows)
    units_rounds: list[PromptRounds] = [prompt_rounds(row["rounds"], row["accepted_per_position"]) for row in rows]
    buckets: dict[str, list[PromptRounds]] = {}
    for unit, unit_rounds in zip(units, units_rounds):
        for bucket in unit.buckets():
            buckets.setdefault(bucket, []).append(unit_rounds)
    overall = bucket_report(units_rounds)
    generated = sum(row["generated_tokens"] for row in rows)
    summary = {
        "engine": kind, "steps": steps, "max_new_tokens": max_tokens, "temperature": temperature,
        "concurrency": concurrency, "unit": units_label(concurrency),
        "prompts": sum(len(unit.prompts) for unit in units), "rounds": rounds,
        "mean_accept_length": overall["mean_accept_length"],
        "mean_accept_length_interval": {"low": overall["low"], "high": overall["high"], "prompts": overall["prompts"]},
        "acceptance_by_position": [count / rounds if rounds else 0.0 for count in accepted],
        "accepted_per_position": accepted,
        "buckets": {name: bucket_report(values) for name, values in sorted(buckets.items())},
        "per_prompt": rows, "generated_tokens": generated, "seconds": replay["seconds"],
        "tokens_per_second": generated / replay["seconds"] if replay["seconds"] else 0.0,
    }
    return EngineSuites.model_validate(summary).as_json()
