"""What a generation backend is asked and answers, shared by the local and the OpenAI-compatible backends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol


@dataclass
class GenerationRequest:
    """One assistant turn to write: the history up to it, as chat messages."""

    record_id: str
    turn: int
    messages: list[dict[str, str]]
    seed: int


@dataclass
class GenerationReply:
    record_id: str
    turn: int
    text: Optional[str] = None
    reasoning: Optional[str] = None
    finish_reason: str = ""
    completion_tokens: int = 0
    error: Optional[str] = None


class Generator(Protocol):
    backend: str
    streams_records: bool   # True: also has `client()` and async `generate_one(client, request)`

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationReply]:
        """Answer every request (errors are replies with `error` set, never exceptions)."""
        ...

    def close(self) -> None: ...
