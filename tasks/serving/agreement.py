"""Does the engine draft what our offline decoder drafts? Same prompts, same budget, per-position counts, a test.

This is the check for engines that count accepted draft tokens per position (vLLM); SGLang, which does not, is
checked on totals instead (tasks/serving/totals_agreement.py); `AGREEMENT_CHECKS` says which engine gets which.

The agreement run sends the offline evaluation's own prompts (its rendered token ids, so the chat rendering is the
same by construction) to the drafting engine's `/v1/completions`, one at a time, with the evaluation's
`max_new_tokens`, temperature and chain length, reading the engine's speculative counters around each prompt. At
every draft position the engine's accepted/drafted count is set against the offline decoder's with a two-sided
two-proportion z-test: the check fails when a position differs significantly (p < `registry.agreement_alpha`) or
when one side accepts nothing at a position where, at the other side's rate, accepting none of its drafts would have
a chance below that level (an exact binomial bound: the normal test is weakest exactly there).
With fewer than `registry.agreement_min_drafts` drafts at a position on either side it cannot tell and says
"inconclusive" with the numbers (the registry treats that as a gate it could not measure). The relative gap of the
mean accept lengths is kept as information only: near 1.0 it cannot see an engine that accepts nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from contract.reports import ModeAcceptance
from tasks.serving.counted_completions import CountedMemo, complete_unit


@dataclass
class PositionCounts:
    """Rounds drafted, and accepted draft tokens at each position (position i accepted implies all before it)."""

    drafts: float = 0.0
    accepted: list[float] = field(default_factory=list)

    def add(self, drafts: float, accepted: Sequence[float]) -> None:
        self.drafts += drafts
        if len(self.accepted) < len(accepted):
            self.accepted += [0.0] * (len(accepted) - len(self.accepted))
        for position, count in enumerate(accepted):
            self.accepted[position] += count

    def accepted_at(self, position: int) -> float:
        return self.accepted[position] if position < len(self.accepted) else 0.0

    def rate(self, position: int) -> Optional[float]:
        return self.accepted_at(position) / self.drafts if self.drafts else None

    def mean_accept_length(self) -> Optional[float]:
        return 1.0 + sum(self.accepted) / self.drafts if self.drafts else None


def two_proportion_p_value(accepted_a: float, drafts_a: float, accepted_b: float, drafts_b: float) -> float:
    """Two-sided p of the pooled two-proportion z-test; 1.0 when both rates are 0 or 1 (nothing to tell apart)."""
    pooled = (accepted_a + accepted_b) / (drafts_a + drafts_b)
    variance = pooled * (1.0 - pooled) * (1.0 / drafts_a + 1.0 / drafts_b)
    if variance <= 0.0:
        return 1.0 if accepted_a / drafts_a == accepted_b / drafts_b else 0.0
    z = (accepted_a / drafts_a - accepted_b / drafts_b) / math.sqrt(variance)
    return math.erfc(abs(z) / math.sqrt(2.0))


def position_rows(engine: PositionCounts, offline: PositionCounts, steps: int) -> list[dict[str, Any]]:
    """The per-position table: both sides' counts and rates, and the test's p-value."""
    rows = []
    for position in range(steps):
        engine_accepted, offline_accepted = engine.accepted_at(position), offline.accepted_at(position)
        row: dict[str, Any] = {
            "position": position + 1,
            "engine": {"accepted": engine_accepted, "drafted": engine.drafts, "rate": engine.rate(position)},
            "offline": {"accepted": offline_accepted, "drafted": offline.drafts, "rate": offline.rate(position)},
            "p_value": None,
        }
        if engine.drafts and offline.drafts:
            row["p_value"] = two_proportion_p_value(engine_accepted, engine.drafts, offline_accepted, offline.drafts)
        rows.append(row)
    return rows


def one_side_silent(row: dict[str, Any], alpha: float) -> bool:
    """One side accepts nothing at this position, and at the other side's rate accepting none of its drafts has a
    chance below `alpha`: (1 - rate)^drafts."""
    for silent, other in (("engine", "offline"), ("offline", "engine")):
        rate = row[other]["rate"] or 0.0
        if row[silent]["accepted"] == 0.0 and rate > 0.0 and (1.0 - rate) ** row[silent]["drafted"] < alpha:
            return True
    return False


def agreement_verdict(engine: PositionCounts, offline: PositionCounts, steps: int, alpha: float,
                      min_drafts: int) -> dict[str, Any]:
    """ok, failed (naming the position, both rates and counts) or inconclusive (too few drafts to tell)."""
    rows = position_rows(engine, offline, steps)
    verdict: dict[str, Any] = {"alpha": alpha, "min_drafts": min_drafts, "positions": rows,
                               "engine_mean_accept_length": engine.mean_accept_length(),
                               "offline_mean_accept_length": offline.mean_accept_length()}
    lengths = (verdict["engine_mean_accept_length"], verdict["offline_mean_accept_length"])
    verdict["relative_gap"] = abs(lengths[0] - lengths[1]) / lengths[1] if None not in lengths else None
    p_values = [row["p_value"] for row in rows if row["p_value"] is not None]
    verdict["min_p_value"] = min(p_values) if p_values else None
    differing = [row for row in rows
                 if one_side_silent(row, alpha) or (row["p_value"] is not None and row["p_value"] < alpha)]
    if differing:
        verdict.update(status="failed", reason="; ".join(describe(row) for row in differing))
    elif min(engine.drafts, offline.drafts) < min_drafts:
        verdict.update(status="inconclusive", reason=(
            f"too few drafts to tell: engine {engine.drafts:g}, offline {offline.drafts:g} rounds "
            f"(registry.agreement_min_drafts {min_drafts}); more or longer evaluation prompts decide it"))
    else:
        verdict["status"] = "ok"
    return verdict


def exact_differences(per_prompt: list[dict[str, Any]]) -> list[str]:
    """The prompts whose engine rounds or acceptance per position differ from the offline decoder's at all
    (`registry.agreement_exact`), each as 'prompt: engine ... offline ...'."""
    differing = []
    for row in per_prompt:
        engine, offline = row["engine"], row["offline"]
        if offline is None:
            differing.append(f"{row['prompt']}: not in the offline evaluation")
            continue
        engine_side = (float(engine["drafts"]), [float(count) for count in engine["accepted_per_position"]])
        offline_side = (float(offline["rounds"]), [float(count) for count in offline["accepted_per_position"]])
        if engine_side != offline_side:
            differing.append(f"{row['prompt']}: engine {engine_side[0]:g} rounds accepting {engine_side[1]}, "
                             f"offline {offline_side[0]:g} accepting {offline_side[1]}")
    return differing


def describe(row: dict[str, Any]) -> str:
    engine, offline = row["engine"], row["offline"]
    p_value = "n/a" if row["p_value"] is None else f"{row['p_value']:.2g}"
    return (f"position {row['position']}: engine accepted {engine['accepted']:g}/{engine['drafted']:g} "
            f"({(engine['rate'] or 0.0):.1%}), offline {offline['accepted']:g}/{offline['drafted']:g} "
            f"({(offline['rate'] or 0.0):.1%}), p = {p_value}")


def offline_counts(chain: ModeAcceptance) -> PositionCounts:
    """The offline decoder's counts from the evaluate report's chain section."""
    return PositionCounts(float(chain.rounds), [float(count) for count in chain.accepted_per_position])


def engine_counts(per_prompt: list[dict[str, Any]]) -> PositionCounts:
    counts = PositionCounts()
    for row in per_prompt:
        counts.add(row["drafts"], row["accepted_per_position"])
    return counts


#: Which check each engine can pass or fail: per draft position where its metrics count accepted tokens per
#: position (vLLM); on totals where only each request's verify rounds and tokens are reported (SGLang's /generate,
#: tasks/serving/totals_agreement.py). An engine not named here can only be waived
#: (registry.waive_gates.engine_acceptance, with its reason).
AGREEMENT_CHECKS = {"vllm": "per_position", "sglang": "totals"}


def run_agreement(engine: Any, kind: str, prompts: Sequence[Any], max_tokens: int, temperature: float,
                  memo: Optional[CountedMemo] = None) -> list[dict[str, Any]]:
    """Each prompt's ids through `/v1/completions`, one at a time; the engine's counters around each one (a prompt
    `memo` holds, sent alone to this engine with the same budget and temperature, is not sent again)."""
    rows = []
    for prompt in prompts:
        reused = memo is not None and memo.holds(prompt, max_tokens, temperature)
        counted = complete_unit(engine, kind, [prompt], max_tokens, temperature, memo)
        reply = counted.replies[0]
        rows.append({"prompt": prompt.key, "text": reply["choices"][0]["text"],
                     "output_tokens": (reply.get("usage") or {}).get("completion_tokens"),
                     "drafts": counted.drafts, "accepted_per_position": counted.accepted_per_position,
                     "from_suite_replay": reused})
    return rows
