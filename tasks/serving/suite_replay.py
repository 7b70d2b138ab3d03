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

SGLang has no per-position counters, but its native `/generate` reports each request's own verify rounds and tokens
(tasks/serving/generated_replies.py). There every prompt is its own unit whatever `benchmark.suite_concurrency`
(which only sets how many are in flight, batched by the engine), its τ the tokens of its rounds over its rounds (the
totals agreement's definition, tasks/serving/totals_agreement.py), and the report has no acceptance by position.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from contract.hashing import hash_text
from contract.reports import EngineSuites
from tasks.common.intervals import PromptRounds, generated_rounds, prompt_rounds
from tasks.common.progress import advance, progress_bar
from tasks.common.suite_summary import bucket_names, bucket_report, prompt_hash
from tasks.data.held_out import EvalPrompt
from tasks.serving.counted_completions import CountedMemo, complete_unit
from tasks.serving.generated_replies import GeneratedMemo

#: Engines whose replies are counted one request at a time (SGLang's /generate meta_info), not by global counters.
PER_REQUEST_ENGINES = ("sglang",)

ReplayMemo = Union[CountedMemo, GeneratedMemo]


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


def counts_per_request(kind: Optional[str]) -> bool:
    return kind in PER_REQUEST_ENGINES


def unit_size(kind: Optional[str], concurrency: int) -> int:
    """Prompts per unit: those in flight together on vLLM (its counters cannot tell them apart), one on SGLang."""
    return 1 if counts_per_request(kind) else concurrency


def replay_memo(kind: str) -> ReplayMemo:
    """What the suite replay keeps of its single prompts for the agreement run on the same engine."""
    return GeneratedMemo() if counts_per_request(kind) else CountedMemo()


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


def replay_suites(engine: Any, kind: str, units: Sequence[ReplayUnit], max_tokens: int, temperature: float,
                  memo: Optional[ReplayMemo] = None, concurrency: int = 1) -> dict[str, Any]:
    """Each unit's prompts on the engine: {"rows": one per unit, "seconds"}. vLLM: one unit at a time, its counters
    read around it; SGLang: every prompt (a unit of one) counted by its own reply, `concurrency` in flight. Single
    prompts go through `memo` (replay_memo(kind) when none is given), so a later agreement run reuses them."""
    memo = memo if memo is not None else replay_memo(kind)
    if isinstance(memo, GeneratedMemo):
        return replay_generated(engine, kind, units, max_tokens, temperature, memo, concurrency)
    return replay_counted(engine, kind, units, max_tokens, temperature, memo)


def replay_counted(engine: Any, kind: str, units: Sequence[ReplayUnit], max_tokens: int, temperature: float,
                   memo: CountedMemo) -> dict[str, Any]:
    """Each unit's prompts on the engine, one unit at a time, its counters read around them."""
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


def replay_generated(engine: Any, kind: str, units: Sequence[ReplayUnit], max_tokens: int, temperature: float,
                     memo: GeneratedMemo, concurrency: int) -> dict[str, Any]:
    """Every unit's prompt through SGLang's /generate, `concurrency` in flight: a row of its verify rounds and
    tokens each (the prompt's own, from its reply's meta_info)."""
    grouped = [unit.key for unit in units if len(unit.prompts) != 1]
    if grouped:
        raise ValueError(f"{kind} counts each prompt by its own reply: units of one prompt only, not {grouped[0]}")
    prompts = [unit.prompts[0] for unit in units]
    started = time.perf_counter()
    with progress_bar(f"{kind}: suites on the engine", len(units)) as bar:
        replies = memo.generate(engine.root_url, prompts, max_tokens, temperature, concurrency,
                                on_reply=lambda: advance(bar, 1))
    rows = [{"prompt": unit.key, "source": unit.source, "input_hash": unit.input_hash, "rounds": reply.verify_rounds,
             "generated_tokens": reply.completion_tokens} for unit, reply in zip(units, replies)]
    return {"rows": rows, "seconds": time.perf_counter() - started}


def row_rounds(row: dict[str, Any]) -> PromptRounds:
    """A replay row's share of τ: from its accepted tokens per position (vLLM), else from its tokens (SGLang)."""
    if "accepted_per_position" in row:
        return prompt_rounds(row["rounds"], row["accepted_per_position"])
    return generated_rounds(row["rounds"], row["generated_tokens"])


def position_fields(kind: str, rows: Sequence[dict[str, Any]], steps: int, rounds: int) -> dict[str, Any]:
    """Acceptance by draft position summed over the rows; on SGLang, why there is none."""
    if counts_per_request(kind):
        return {"per_position": f"{kind} counts no accepted tokens per draft position: τ is each prompt's tokens "
                                "(all it emitted but the prefill's) over its verify rounds, from /generate's meta_info"}
    accepted = [sum(row["accepted_per_position"][position] for row in rows
                    if position < len(row["accepted_per_position"])) for position in range(steps)]
    return {"acceptance_by_position": [count / rounds if rounds else 0.0 for count in accepted],
            "accepted_per_position": accepted}


def suites_summary(kind: str, replay: dict[str, Any], units: Sequence[ReplayUnit], steps: int, max_tokens: int,
                   temperature: float, concurrency: int) -> dict[str, Any]:
    """benchmark/report.json's `engines.<kind>.suites` (contract/reports.py's EngineSuites) from the replay's rows."""
    rows = replay["rows"]
    rounds = sum(row["rounds"] for row in rows)
    units_rounds: list[PromptRounds] = [row_rounds(row) for row in rows]
    buckets: dict[str, list[PromptRounds]] = {}
    for unit, unit_rounds in zip(units, units_rounds):
        for bucket in unit.buckets():
            buckets.setdefault(bucket, []).append(unit_rounds)
    overall = bucket_report(units_rounds)
    generated = sum(row["generated_tokens"] for row in rows)
    summary = {
        "engine": kind, "steps": steps, "max_new_tokens": max_tokens, "temperature": temperature,
        "concurrency": concurrency, "unit": units_label(unit_size(kind, concurrency)),
        "prompts": sum(len(unit.prompts) for unit in units), "rounds": rounds,
        "mean_accept_length": overall["mean_accept_length"],
        "mean_accept_length_interval": {"low": overall["low"], "high": overall["high"], "prompts": overall["prompts"]},
        **position_fields(kind, rows, steps, rounds),
        "buckets": {name: bucket_report(values) for name, values in sorted(buckets.items())},
        "per_prompt": rows, "generated_tokens": generated, "seconds": replay["seconds"],
        "tokens_per_second": generated / replay["seconds"] if replay["seconds"] else 0.0,
    }
    return EngineSuites.model_validate(summary).as_json()
