"""Which ingested conversations are copies of one already taken, so that copies do not count as data.

The target regenerates every assistant turn from the user (and system) turns alone, greedily by default, so
two conversations with the same user turns become the same training record. `data.dedupe` chooses the key:

- `user_turns` (default): the normalised system and user turns, in order. Copies go; conversations that share
  an opening but differ later stay (their later turns are new data).
- `first_prompt`: the normalised first user turn only (stricter: one conversation per opening).
- `none`: keep every item (ids are still unique).

Pre-templated `text` records are keyed by their normalised text in both modes.
"""

from __future__ import annotations

from typing import Optional

from tasks.data.formats import Normalised
from tasks.data.split import normalise_prompt

SEPARATOR = "\x1f"


def conversation_key(normalised: Normalised, mode: str) -> Optional[str]:
    """The key two copies share under `mode`; None when the item is never deduplicated."""
    if mode == "none":
        return None
    if normalised.text is not None:
        return "text:" + normalise_prompt(normalised.text)
    prompts = [message for message in normalised.messages if message.role in ("system", "user")]
    if mode == "first_prompt":
        first_user = next((message for message in prompts if message.role == "user"), None)
        return "first:" + normalise_prompt(first_user.content) if first_user is not None else None
    return "turns:" + SEPARATOR.join(f"{message.role}:{normalise_prompt(message.content)}" for message in prompts)
