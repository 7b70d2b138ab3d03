"""Prompts sent to a serving engine as token ids, with the engine's speculative counters read around them.

The agreement check (tasks/serving/agreement.py) and the suite replay (tasks/serving/suite_replay.py) both need
the same thing: eaglet's own token ids through `/v1/completions` (no chat template on the engine's side), and
the drafts and accepted tokens per draft position that these requests, and only these, added to the counters.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import httpx

from tasks.serving.spec_counters import speculative_window

#: a CPU engine drafting a long reply for a group of prompts takes minutes, not seconds
REQUEST_TIMEOUT_S = 600.0


@dataclass
class CountedReplies:
    """The engine's replies and the counter window around them (`drafts`, `accepted_per_position`)."""

    replies: list[dict[str, Any]]
    window: dict[str, Any]

    @property
    def drafts(self) -> float:
        return float(self.window.get("drafts") or 0.0)

    @property
    def accepted_per_position(self) -> list[float]:
        return list(self.window.get("accepted_per_position") or [])

    @property
    def completion_tokens(self) -> int:
        return sum(int((reply.get("usage") or {}).get("completion_tokens") or 0) for reply in self.replies)


async def complete_all(engine: Any, prompts: Sequence[Any], max_tokens: int,
                       temperature: float) -> list[dict[str, Any]]:
    """Every prompt's completion (prompts carry `input_ids`), all in flight at once; raises on the first failure."""
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        async def complete(prompt: Any) -> dict[str, Any]:
            body = {"model": engine.launch.served_model_name, "prompt": list(prompt.input_ids),
                    "max_tokens": max_tokens, "temperature": temperature}
            response = await client.post(f"{engine.base_url}/completions", json=body)
            response.raise_for_status()
            return response.json()

        return list(await asyncio.gather(*(complete(prompt) for prompt in prompts)))


def complete_counted(engine: Any, kind: str, prompts: Sequence[Any], max_tokens: int,
                     temperature: float) -> CountedReplies:
    """The prompts' completions and the speculative counters' change while they ran (nothing else in flight)."""
    before = engine.read_metrics()
    replies = asyncio.run(complete_all(engine, prompts, max_tokens, temperature))
    return CountedReplies(replies, speculative_window(kind, before, engine.read_metrics()))


@dataclass
class CountedMemo:
    """Single prompts already sent to one engine, by token ids, budget and temperature: the suite replay's rows
    answer the agreement check for the reference prompts the suites hold, so those are not generated twice."""

    replies: dict[tuple[tuple[int, ...], int, float], CountedReplies] = field(default_factory=dict)

    def holds(self, prompt: Any, max_tokens: int, temperature: float) -> bool:
        return (tuple(prompt.input_ids), max_tokens, temperature) in self.replies

    def complete(self, engine: Any, kind: str, prompt: Any, max_tokens: int, temperature: float) -> CountedReplies:
        """The prompt's counted reply: from an earlier identical request to this engine, else sent now."""
        key = (tuple(prompt.input_ids), max_tokens, temperature)
        if key not in self.replies:
            self.replies[key] = complete_counted(engine, kind, [prompt], max_tokens, temperature)
        return self.replies[key]


def complete_unit(engine: Any, kind: str, prompts: Sequence[Any], max_tokens: int, temperature: float,
                  memo: Optional[CountedMemo]) -> CountedReplies:
    """A unit's counted replies; a single prompt goes through the memo when there is one."""
    if memo is not None and len(prompts) == 1:
        return memo.complete(engine, kind, prompts[0], max_tokens, temperature)
    return complete_counted(engine, kind, prompts, max_tokens, temperature)
