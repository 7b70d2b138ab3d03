"""Separating a response's reasoning from its answer, under the run's reasoning mode.

mode off: a response carrying reasoning markers is refused (it would teach the drafter text the serving
          engine never shows). mode save: reasoning goes to `reasoning_content`, from the server's own
          field or parsed out of `<think>...</think>`; an unclosed tag is refused.
"""

from __future__ import annotations

from typing import Optional

from contract.chat_rendering import THINK_CLOSE, THINK_OPEN


class ReasoningError(ValueError):
    """A response that does not fit the reasoning mode; the message is the record's error reason."""


def has_reasoning_markers(text: str) -> bool:
    return THINK_OPEN in text or THINK_CLOSE in text


def split_reasoning(text: str, mode: str, server_reasoning: Optional[str] = None) -> tuple[str, Optional[str]]:
    """(content, reasoning_content) of one response."""
    if mode == "off":
        if has_reasoning_markers(text) or server_reasoning:
            raise ReasoningError("response contains reasoning but regeneration.reasoning is 'off'")
        return text, None
    if server_reasoning is not None:
        if has_reasoning_markers(text):
            raise ReasoningError("server returned reasoning_content but the content still has think tags")
        return text, server_reasoning
    opened = text.find(THINK_OPEN)
    closed = text.find(THINK_CLOSE)
    if opened == -1 and closed == -1:
        return text, None
    if closed == -1:
        raise ReasoningError("unclosed <think> tag in the response")
    if opened != -1 and opened < closed:
        if text[:opened].strip():
            raise ReasoningError("text before the <think> block")
        start = opened + len(THINK_OPEN)
    else:
        start = 0  # the template opened the block inside the prompt; only the closing tag is generated
    reasoning = text[start:closed].strip()
    content = text[closed + len(THINK_CLOSE):].lstrip()
    if has_reasoning_markers(content):
        raise ReasoningError("more than one think block in the response")
    return content, reasoning
