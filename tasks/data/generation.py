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
    """One answered turn, or its error. `refused`: the server answered with a status not worth retrying (a 4xx
    other than 408/409/425/429): the request itself is wrong, so many in a row stop the regenerate stage."""

    record_id: str
    turn: int
    text: Optional[str] = None
    reasoning: Optional[str] = None
    finish_reason: str = ""
    completion_tokens: int = 0
    error: Optional[str] = None
    refused: bool = False


class Generator(Protocol):
    backend: str
    streams_records: bool   # True: also has `client()` and async `generate_one(client, request)`

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationReply]:
        """Answer every request (errors are replies with `error` set, never exceptions)."""
        ...

    def close(self) -> None: ...
