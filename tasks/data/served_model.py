"""Which model a regeneration server serves: checked against the run before any request, remembered with replies.

A server at `regeneration.base_url` is only trusted to be the run's target when its `GET /v1/models` names the
model the config expects: `regeneration.served_model_name` (what an engine started with `--served-model-name`
serves), else `model.path` for a local target and `model.id` otherwise (what vLLM and SGLang serve by default).
Another name is refused with both names, before a reply is written. Its identity (the name, the weights it was
started from, its context length: `IDENTITY_FIELDS` of the model card, which vLLM and SGLang both report) goes into
the regenerate journal (a journal another server wrote is not extended, tasks/regenerate.py) and into the stage's
cache key (flows/outside_inputs.py), so another model behind the same port, even under the same name, neither
extends nor reuses the old replies.
"""

from __future__ import annotations

from typing import Any, Optional

import httpx

from contract.config import RegenerationConfig
from tasks.data.server_access import ServerAccess

#: Model-card fields that say which model answers; `created` and `permission` change between requests.
IDENTITY_FIELDS = ("id", "root", "max_model_len")


class ServedModelMismatch(ValueError):
    """The server serves another model than the run's target: every reply would come from the wrong model."""


def read_model_card(access: ServerAccess, timeout_s: float) -> dict[str, Any]:
    """The first model card of the server's `GET /models` (engines serve one model); HTTP errors and a body
    without a card raise (httpx.HTTPError, KeyError, IndexError, ValueError)."""
    response = httpx.get(f"{access.base_url}/models", headers=access.headers, timeout=timeout_s)
    response.raise_for_status()
    card = response.json()["data"][0]
    if not isinstance(card, dict) or not isinstance(card.get("id"), str):
        raise ValueError(f"{access.base_url}/models: a model card without an id: {str(card)[:200]}")
    return card


def identity_of(card: dict[str, Any]) -> dict[str, Any]:
    """What of a model card identifies the served model."""
    return {name: card[name] for name in IDENTITY_FIELDS if name in card}


def expected_name(settings: RegenerationConfig, target_info: dict[str, Any]) -> tuple[str, str]:
    """The model name the server at regeneration.base_url must serve, and the config field that gives it: the
    configured served name, else the target's id as target.json records it (model.path of a local target)."""
    if settings.served_model_name is not None:
        return settings.served_model_name, "regeneration.served_model_name"
    return target_info["id"], "model.path" if target_info.get("source") == "local" else "model.id"


def check_served_name(served: str, expected: str, field: str, url: str) -> None:
    """Refuse a server that names another model than the one the run expects."""
    if served == expected:
        return
    raise ServedModelMismatch(
        f"{url} serves the model '{served}', but this run expects '{expected}' ({field}): point "
        f"regeneration.base_url at a server of the run's target, or, when this is it under another name "
        f"(--served-model-name), set regeneration.served_model_name: {served}")


def served_identity_or_none(accesses: list[ServerAccess], timeout_s: float) -> Optional[dict[str, Any]]:
    """The identity of the first endpoint (in regeneration.base_url order) that answers, or None when none does."""
    for access in accesses:
        try:
            return identity_of(read_model_card(access, timeout_s))
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            continue
    return None
