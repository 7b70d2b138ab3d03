"""Agreement for an engine without per-position counters (SGLang): tokens per verify round, engine vs offline.

SGLang counts no accepted tokens per draft position, but its native `POST /generate` reports per request how many
verify rounds it ran (`meta_info.spec_verify_ct`) and how many tokens it produced (`meta_info.completion_tokens`).
The offline evaluation's prompts are replayed there (their token ids, the evaluation's budget and temperature, one at
a time) and compared with what the offline decoder did on the same prompts (evaluate/acceptance.json, chain
`per_prompt`: rounds and generated tokens).

"Tokens per round" is defined the same on both sides: the tokens a request emitted minus the prefill's one (that
token comes from the prompt's forward, not from a verify round; SGLang's completion_tokens counts it, as does the
offline decoder's generated_tokens), over its verify rounds. Each round emits its accepted drafts plus the bonus
token, so this is the mean accept length, except that the request's last round may be cut by the budget or by
EOS: both sides cut it by the same rule (stop at max_new_tokens, stop after EOS) and count it as a round, so the
cut is the same on both sides and the offline `mean_accept_length` (uncut rounds) is not what is compared.

The test: rounds within one prompt are not independent (a prompt is easy or hard throughout), so the unit is the
prompt. Each side's tokens per round is a ratio estimator R = sum tokens / sum rounds over its prompts, with the
delta-method variance m / (m - 1) * sum_i (tokens_i - R rounds_i)^2 / (sum rounds)^2 (m prompts), which weights a
prompt by its rounds as the total does and needs no assumption on how tokens per round is distributed. The two
sides are compared with a two-sided z-test, z = (R_engine - R_offline) / sqrt(var_engine + var_offline). It treats
the sides as independent samples although they decoded the same prompts: that ignores a positive correlation,
which only widens the interval, so a failure is a real difference. It fails when p < `registry.agreement_alpha`;
with fewer than `registry.agreement_min_drafts` verify rounds on either side, or fewer than two prompts (no
spread to test against), it says "inconclusive" with the numbers, like the per-position check.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from contract.reports import PromptAcceptance
from tasks.common.intervals import round_tokens
from tasks.serving.generated_replies import GeneratedMemo


@dataclass(frozen=True)
class PromptRounds:
    """One prompt on one side: verify rounds and the tokens they emitted (the prefill's token left out)."""

    prompt: str
    rounds: int
    tokens: int


def offline_rounds(per_prompt: Sequence[PromptAcceptance]) -> list[PromptRounds]:
    return [PromptRounds(row.prompt, row.rounds, round_tokens(row.generated_tokens)) for row in per_prompt]


@dataclass(frozen=True)
class RatioEstimate:
    """Tokens per round over prompts, with its variance (None: fewer than two prompts)."""

    prompts: int
    rounds: int
    tokens: int
    tokens_per_round: Optional[float]
    variance: Optional[float]


def ratio_estimate(rows: Sequence[PromptRounds]) -> RatioEstimate:
    """sum tokens / sum rounds and its delta-method variance with the prompt as the unit."""
    rounds, tokens = sum(row.rounds for row in rows), sum(row.tokens for row in rows)
    if not rounds:
        return RatioEstimate(len(rows), rounds, tokens, None, None)
    ratio = tokens / rounds
    if len(rows) < 2:
        return RatioEstimate(len(rows), rounds, tokens, ratio, None)
    spread = sum((row.tokens - ratio * row.rounds) ** 2 for row in rows)
    return RatioEstimate(len(rows), rounds, tokens, ratio, len(rows) / (len(rows) - 1) * spread / rounds ** 2)


def z_test_p_value(engine: RatioEstimate, offline: RatioEstimate) -> Optional[float]:
    """Two-sided p of the difference of the two ratios; 1.0 or 0.0 when neither side varies."""
    if None in (engine.tokens_per_round, offline.tokens_per_round, engine.variance, offline.variance):
        return None
    difference = engine.tokens_per_round - offline.tokens_per_round
    spread = math.sqrt(engine.variance + offline.variance)
    if spread == 0.0:
        return 1.0 if difference == 0.0 else 0.0
    return math.erfc(abs(difference / spread) / math.sqrt(2.0))


def totals_verdict(engine_rows: Sequence[PromptRounds], offline_rows: Sequence[PromptRounds], alpha: float,
                   min_drafts: int) -> dict[str, Any]:
    """ok, failed (both sides' tokens per round, rounds and p) or inconclusive (too few rounds or prompts)."""
    offline_by_prompt = {row.prompt: row for row in offline_rows}
    unmatched = sorted(row.prompt for row in engine_rows if row.prompt not in offline_by_prompt)
    if unmatched:
        return {"status": "failed", "reason": f"the offline evaluation has no prompt {', '.join(unmatched)}: it was "
                                              "made on other prompts; rerun the evaluate stage"}
    paired = [offline_by_prompt[row.prompt] for row in engine_rows]
    engine, offline = ratio_estimate(engine_rows), ratio_estimate(paired)
    p_value = z_test_p_value(engine, offline)
    lengths = (engine.tokens_per_round, offline.tokens_per_round)
    verdict: dict[str, Any] = {
        "alpha": alpha, "min_drafts": min_drafts, "min_p_value": p_value,
        "engine_mean_accept_length": lengths[0], "offline_mean_accept_length": lengths[1],
        "relative_gap": abs(lengths[0] - lengths[1]) / lengths[1] if None not in lengths and lengths[1] else None,
        "totals": {"engine": asdict(engine), "offline": asdict(offline), "p_value": p_value},
        "per_prompt": [{"prompt": row.prompt, "engine": asdict(row), "offline": asdict(paired_row)}
                       for row, paired_row in zip(engine_rows, paired)],
    }
    numbers = (f"tokens per verify round engine {shown(lengths[0])} over {engine.rounds} rounds, offline "
               f"{shown(lengths[1])} over {offline.rounds} rounds, {engine.prompts} prompts")
    if p_value is not None and p_value < alpha:
        verdict.update(status="failed", reason=f"{numbers}: p = {p_value:.2g}")
    elif p_value is None or min(engine.rounds, offline.rounds) < min_drafts:
        verdict.update(status="inconclusive", reason=(
            f"too few verify rounds or prompts to tell: {numbers} (registry.agreement_min_drafts {min_drafts}, at "
            "least 2 prompts); more or longer evaluation prompts decide it"))
    else:
        verdict["status"] = "ok"
    return verdict


def shown(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def replay_generate(root_url: str, prompts: Sequence[Any], max_tokens: int, temperature: float,
                    memo: Optional[GeneratedMemo] = None) -> list[dict[str, Any]]:
    """Each prompt's ids through SGLang's native `/generate`, one at a time; its verify rounds and tokens. Prompts
    `memo` holds (the suite replay sent them) are read from it, not generated again."""
    replies = (memo if memo is not None else GeneratedMemo()).generate(root_url, prompts, max_tokens, temperature)
    return [reply.row(prompt.key) for prompt, reply in zip(prompts, replies)]


def engine_rounds(replayed: Sequence[dict[str, Any]]) -> list[PromptRounds]:
    """The replay's rows as rounds and tokens, defined as on the offline side."""
    return [PromptRounds(row["prompt"], row["verify_rounds"], round_tokens(row["completion_tokens"]))
            for row in replayed]
