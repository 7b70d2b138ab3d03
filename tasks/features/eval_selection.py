"""Which held-out records become eval features when `capture.eval_records` caps them.

The trainer's held-out loss and acc_k read every eval feature at each `training.eval_interval`; past a few dozen
records they cost more capture and training time than they add certainty (the evaluate stage, not the trainer,
reports acceptance with intervals). The cap keeps records spread over the sources round-robin, in file order
within each source, so a small cap still sees every held-out suite; every record left out stays counted in the
capture report as a skipped outcome with the reason.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

from contract.chat_rendering import TURN_SUFFIX


def record_key(sample_key: str) -> str:
    """`eval.jsonl:7#turn1` -> `eval.jsonl:7`: the turns of one record are kept or left out together."""
    return sample_key.split(TURN_SUFFIX, 1)[0]


def spread_over_sources(keys: Sequence[str], source_of: dict[str, str], cap: Optional[int]) -> list[str]:
    """Up to `cap` record keys, taking one per source in turn (sources in order of first appearance)."""
    if cap is None or cap >= len(keys):
        return list(keys)
    queues: OrderedDict[str, list[str]] = OrderedDict()
    for key in keys:
        queues.setdefault(source_of.get(key, ""), []).append(key)
    kept: list[str] = []
    while len(kept) < cap:
        for queue in queues.values():
            if queue and len(kept) < cap:
                kept.append(queue.pop(0))
    position = {key: index for index, key in enumerate(keys)}
    return sorted(kept, key=position.__getitem__)


def not_kept_reason(cap: int) -> str:
    """The skipped outcome's reason for an eval record beyond the cap."""
    return (f"not captured: capture.eval_records keeps {cap} held-out records for the trainer's evaluation, "
            "spread over the sources")
