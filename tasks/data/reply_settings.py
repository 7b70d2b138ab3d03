"""Which settings change the target's replies: the one declaration that keys the regenerate journal
(tasks/regenerate.py `settings_fingerprint`) and the regenerate stage's cache key (flows/stages.py STAGE_READS,
mirrored by dvc.yaml's params).

How requests travel (endpoints, timeouts, retries, ports), who sends them (credentials) and how they are scheduled
change no reply, so raising a timeout after a crash, dropping a dead replica or moving an engine's port resumes the
journal and reuses the stage. Every other field of `regeneration` and of an engine counts, so a field added to the
config later changes the key until someone declares it here with a reason.
"""

from __future__ import annotations

import typing
from typing import Any

from contract.config import EngineConfig, RegenerationConfig, RunConfig, RuntimeConfig

#: Fields of `regeneration` that change no reply, each with why.
REGENERATION_NOT_REPLIES: dict[str, str] = {
    "base_url": "replicas of one model (generation_openai refuses endpoints serving different models)",
    "api_key": "credentials",
    "api_key_env": "credentials",
    "headers": "credentials and routing",
    "engine_env": "the started engine's threads and memory",
    "concurrency": "requests in flight; every request carries its own seed",
    "batch_size": "records per local forward pass (left padding moves float rounding only)",
    "chunk_records": "how often finished records are committed to the journal (and the local rounds' size)",
    "request_timeout_s": "how long a reply is waited for",
    "max_retries": "how often a failed request is sent again",
    "backoff_initial_s": "the wait before a retry",
    "backoff_max_s": "the longest wait before a retry",
}

#: Fields of a `runtime.engines.<kind>` entry that change no reply, each with why.
ENGINE_NOT_REPLIES: dict[str, str] = {
    "port": "where the engine listens",
    "startup_timeout_s": "how long its start is waited for",
    "env": "its threads, memory and tokens",
    "dtype": "the benchmark's and eaglet serve's: regenerate's engine runs in regeneration.dtype",
    "enforce_eager": "the benchmark's and eaglet serve's: regenerate's engine runs eager",
    "gpus": "which of the host's GPUs it runs on",
}

#: Fields outside those sections that change replies: template arguments, the numerics of the local backend, and
#: the length past which a record's first prompt is not sent (tasks/data/length_gate.py).
MODEL_REPLY_FIELDS: tuple[str, ...] = ("model.chat_template_kwargs", "model.dtype", "model.trust_remote_code",
                                       "runtime.device", "validation.max_length")


def engine_kinds() -> tuple[str, ...]:
    """The engine names `runtime.engines` accepts (the keys of its dict)."""
    key_type = typing.get_args(RuntimeConfig.model_fields["engines"].annotation)[0]
    return typing.get_args(key_type)


def not_reply_fields() -> tuple[str, ...]:
    """Dotted names of every field that changes no reply (what the stage reads but is not keyed on)."""
    engine_fields = [f"runtime.engines.{kind}.{name}" for kind in engine_kinds() for name in ENGINE_NOT_REPLIES]
    return (*(f"regeneration.{name}" for name in REGENERATION_NOT_REPLIES), *engine_fields)


def reply_fields() -> tuple[str, ...]:
    """Dotted names of every field that changes a reply: the regenerate stage's declared reads."""
    regeneration = [f"regeneration.{name}" for name in RegenerationConfig.model_fields
                    if name not in REGENERATION_NOT_REPLIES]
    engines = [f"runtime.engines.{kind}.{name}" for kind in engine_kinds() for name in EngineConfig.model_fields
               if name not in ENGINE_NOT_REPLIES]
    return (*MODEL_REPLY_FIELDS, *regeneration, *engines)


def field_value(cfg: RunConfig, dotted: str) -> Any:
    """The value at a dotted name, read field by field (so a read of it is a read of that field only)."""
    node: Any = cfg
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def reply_settings(cfg: RunConfig) -> dict[str, Any]:
    """Every reply-changing setting of `cfg` by dotted name."""
    return {name: field_value(cfg, name) for name in reply_fields()}
