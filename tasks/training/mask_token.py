"""The token id P-EAGLE's and DFlash's masked slots read (`draft.mask_token_id`), resolved once when the draft is built.

The draft embeds it with the target's frozen embedding, so it must be a row the target has. Resolved in the order
speculators uses: the configured id; the tokenizer's own mask token; the first embedding row beyond the tokenizer's
tokens (a row no text ever produces); else the pad, eos or unk token. The export's config.json carries the id to
vLLM, which reads it as `mask_token_id`.
"""

from __future__ import annotations

from typing import Any, Optional


def resolve_mask_token_id(configured: Optional[int], tokenizer: Any, vocab_size: int, method: str = "peagle") -> int:
    """The mask token id for a target whose embedding has `vocab_size` rows; a clear error when none fits."""
    if configured is not None:
        if configured >= vocab_size:
            raise ValueError(f"draft.mask_token_id {configured} is not a row of the target's embedding "
                             f"({vocab_size} rows)")
        return configured
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"draft.method {method} needs a mask token: the tokenizer has no mask, pad, eos or unk token and "
                     "the embedding no row beyond its tokens; set draft.mask_token_id")
