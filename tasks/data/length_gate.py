"""Records whose first prompt alone is longer than training keeps: the regenerate stage does not send them.

Validate truncates every record to `validation.max_length` tokens and drops the ones left with no supervised token.
A record whose prompt before its first regenerated reply already passes that length is dropped there whatever the
target answers, so writing its replies only spends the engine on it: on ShareGPT V3 such records are one in
sixteen, yet their first prompts hold as many tokens as all the other records' first prompts together (1,000 to
6,000 tokens each, then a second turn that carries them again). The stage counts them `skipped`, with the length
in the reason, before any request is sent.
"""

from __future__ import annotations

from typing import Any, Sequence

from contract.chat_rendering import served_prompt
from contract.records import Message


def prompt_tokens(tokenizer: Any, messages: Sequence[Message], slot: int) -> int:
    """Tokens the engine is sent before assistant turn `slot` (the chat template with its generation prompt)."""
    text = served_prompt(tokenizer, messages, slot)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def over_length_reason(tokens: int, max_length: int) -> str | None:
    """Why a record whose first prompt has `tokens` tokens is not sent, or None when it may be.

    Strictly longer, not equal: a prompt tokenised alone may end one token shorter or longer than the same text
    inside the whole conversation, so a record at the boundary is sent and validate decides."""
    if tokens <= max_length:
        return None
    return (f"the prompt of its first reply is {tokens} tokens, over validation.max_length {max_length}: truncation "
            f"would leave no supervised token (validate drops it), so it was not sent to the target")
