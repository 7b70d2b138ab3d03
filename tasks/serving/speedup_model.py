"""Which number of speculative tokens pays, predicted from offline numbers alone.

A chain drafter that drafts k tokens per round gains the tokens it gets accepted and pays k draft steps plus
one verify forward per round. With the evaluate stage's chain profile (acceptance by depth, unconditional:
the share of rounds whose first d drafted tokens were all accepted) and its measured step times, a round of
k drafted tokens yields `1 + sum(acceptance_by_depth[:k])` tokens (the bonus token included) and costs
`verify_s + k * draft_s`, against `1 / target_tokens_per_s` per token for the target alone:

    predicted speedup(k) = (1 + sum_{d<=k} a_d) / (verify_s + k * draft_s) / target_tokens_per_s

A tree (SGLang's topk > 1) is predicted only where the evaluate stage decoded that very tree: its measured
tokens per round over its measured seconds per round, against the target alone.

The times come from the reference decoder (HF transformers), not from the engine, so the prediction ranks
settings rather than promising an engine's number; the benchmark stage reports it beside the measured one.
"""

from __future__ import annotations

from typing import Any, Optional

from tasks.serving.serving_setting import ServingSetting, matching_offline_mode


def step_times(chain: dict[str, Any]) -> tuple[float, float]:
    """(seconds per verify forward, seconds per drafted token) of the evaluate stage's chain decoding."""
    rounds = chain.get("rounds") or 0
    drafted = (chain.get("mean_drafted_tokens") or 0.0) * rounds
    verify_s = chain["verify_seconds"] / rounds if rounds else 0.0
    draft_s = chain["draft_seconds"] / drafted if drafted else 0.0
    return verify_s, draft_s


def predicted_speedup(acceptance: dict[str, Any], num_speculative_tokens: int) -> Optional[float]:
    """Speedup over the target alone for a chain of `num_speculative_tokens`, from `evaluate/acceptance.json`;
    None when the offline profile is shorter than the chain or a time is missing."""
    chain = acceptance.get("chain") or {}
    by_depth = chain.get("acceptance_by_depth") or []
    target_rate = (acceptance.get("target") or {}).get("tokens_per_second") or 0.0
    if num_speculative_tokens > len(by_depth) or target_rate <= 0:
        return None
    verify_s, draft_s = step_times(chain)
    round_s = verify_s + num_speculative_tokens * draft_s
    if round_s <= 0:
        return None
    tokens_per_round = 1.0 + sum(by_depth[:num_speculative_tokens])
    return tokens_per_round / round_s / target_rate


def predicted_setting_speedup(acceptance: dict[str, Any], setting: ServingSetting) -> Optional[float]:
    """A chain from the chain profile; a tree from the offline tree run of the same setting (None without one)."""
    if setting.is_chain:
        return predicted_speedup(acceptance, setting.steps)
    tree = matching_offline_mode(acceptance, setting)
    target_rate = (acceptance.get("target") or {}).get("tokens_per_second") or 0.0
    if tree is None or not tree.get("rounds") or target_rate <= 0:
        return None
    round_s = (tree["verify_seconds"] + tree["draft_seconds"]) / tree["rounds"]
    return tree["mean_accept_length"] / round_s / target_rate if round_s > 0 else None
