"""The engines' own speculative-decoding numbers -> mean acceptance length and per-position rates.

docs/architecture.md §6.

vLLM exposes counters (`vllm:spec_decode_*_total`, read before and after a window and subtracted); SGLang
exposes gauges (`sglang:spec_accept_length`, `sglang:spec_accept_rate`, averaged over its ranks). The mean
acceptance length counts the bonus token, like the reference decoder's (models/speculative.py).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from tasks.serving.engine import metric_total

VLLM_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
}
VLLM_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SGLANG_GAUGES = {"accept_length": "sglang:spec_accept_length", "accept_rate": "sglang:spec_accept_rate"}


def label_value(key: str, label: str) -> Optional[str]:
    """The value of one label in a 'name{a="1",b="2"}' series key."""
    match = re.search(r'[{,]' + re.escape(label) + r'="([^"]*)"', key)
    return match.group(1) if match else None


def accepted_per_position(metrics: dict[str, float]) -> dict[int, float]:
    """vLLM's accepted tokens per draft position, summed over every other label."""
    positions: dict[int, float] = {}
    for key, value in metrics.items():
        if not key.startswith(VLLM_PER_POSITION + "{"):
            continue
        position = label_value(key, "position")
        if position is not None:
            positions[int(position)] = positions.get(int(position), 0.0) + value
    return positions


def gauge_mean(metrics: dict[str, float], name: str) -> Optional[float]:
    """Mean over the series of a gauge (SGLang exposes one per tp/dp rank); None when absent."""
    values = [value for key, value in metrics.items() if key == name or key.startswith(name + "{")]
    return sum(values) / len(values) if values else None


def speculative_window(kind: str, before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The engine's speculative numbers over the interval between two /metrics reads."""
    if kind == "sglang":
        return {name: gauge_mean(after, metric) for name, metric in SGLANG_GAUGES.items()}
    window: dict[str, Any] = {name: metric_total(after, metric) - metric_total(before, metric)
                              for name, metric in VLLM_COUNTERS.items()}
    first, last = accepted_per_position(before), accepted_per_position(after)
    window["accepted_per_position"] = [last[i] - first.get(i, 0.0) for i in sorted(last)]
    return window


def acceptance(kind: str, window: dict[str, Any]) -> dict[str, Any]:
    """Mean acceptance length (tokens per verification, the bonus token included) and acceptance rates."""
    if kind == "sglang":
        return {"mean_accept_length": window.get("accept_length"), "draft_acceptance_rate": window.get("accept_rate"),
                "acceptance_rate_per_position": []}
    drafts = window["drafts"]
    if drafts <= 0:
        return {"mean_accept_length": None, "draft_acceptance_rate": None, "acceptance_rate_per_position": []}
    rate = window["accepted"] / window["draft_tokens"] if window["draft_tokens"] > 0 else None
    return {
        "mean_accept_length": window["accepted"] / drafts + 1.0,
        "draft_acceptance_rate": rate,
        "acceptance_rate_per_position": [accepted / drafts for accepted in window["accepted_per_position"]],
    }


def overall_acceptance(kind: str, levels: list[dict[str, Any]]) -> dict[str, Any]:
    """Acceptance over all levels: vLLM's counters summed; SGLang's gauges averaged."""
    windows = [level["speculative"]["window"] for level in levels]
    if kind == "sglang":
        combined: dict[str, Any] = {}
        for name in SGLANG_GAUGES:
            values = [window[name] for window in windows if window.get(name) is not None]
            combined[name] = sum(values) / len(values) if values else None
    else:
        combined = {name: sum(window[name] for window in windows) for name in VLLM_COUNTERS}
        per_position: list[float] = []
        for window in windows:
            for position, accepted in enumerate(window["accepted_per_position"]):
                if position == len(per_position):
                    per_position.append(0.0)
                per_position[position] += accepted
        combined["accepted_per_position"] = per_position
    return {"window": combined, **acceptance(kind, combined)}
