"""Only settings that change the target's replies key the regenerate journal and the regenerate stage's cache: a
longer timeout, fewer retries, a dropped replica or a moved engine port resume and reuse; a new temperature does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from contract.config import RunConfig
from contract.config_loading import load_config
from flows.stage_cache import stage_cache_key
from flows.stages import STAGE_READS
from pipeline_inputs import tiny_run_config, write_conversations
from tasks import ingest, regenerate, target
from tasks.common.artifacts import read_json
from tasks.data.journal import Journal
from tasks.data.reply_settings import not_reply_fields, reply_fields

REPLICAS = ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"]  # nothing listens: a request would fail


def with_regeneration(cfg: RunConfig, **changes: Any) -> RunConfig:
    return cfg.model_copy(update={"regeneration": cfg.regeneration.model_copy(update=changes)})


def fingerprint(cfg: RunConfig) -> str:
    params = regenerate.generation_params(cfg, read_json(cfg.output_path / "target.json"))
    return regenerate.settings_fingerprint(params, cfg)


def journal_everything(cfg: RunConfig) -> int:
    """A journal, written under `cfg`, that holds every record as finished (as a run killed at its end leaves)."""
    records = regenerate.read_prompts(cfg.output_path / "data" / "prompts.jsonl")
    journal = Journal(cfg.output_path / "data" / "regenerate.journal.jsonl", fingerprint(cfg))
    journal.load()  # starts it: the header line holds the fingerprint
    journal.commit([regenerate.entry_for(key, record, "ok", None, record) for key, record in records])
    return len(records)


def test_a_journal_survives_a_longer_timeout_and_a_dropped_replica(tmp_path: Path, tiny_target_dir: Path) -> None:
    chats = write_conversations(tmp_path / "inputs" / "chats.jsonl")
    untracked = {"enabled": False}
    cfg = RunConfig.model_validate(tiny_run_config(str(tmp_path / "out"), tiny_target_dir, str(chats), untracked))
    target.run(cfg)
    ingest.run(cfg)
    crashed = with_regeneration(cfg, backend="openai", base_url=REPLICAS, request_timeout_s=5.0)
    journalled = journal_everything(crashed)

    rerun = with_regeneration(crashed, base_url=REPLICAS[:1], request_timeout_s=600.0, max_retries=0,
                              backoff_max_s=60.0, concurrency=1)
    result = regenerate.run(rerun)  # a discarded journal would send every record to a dead replica
    assert (result.report.input, result.report.ok) == (journalled, journalled), "every record came from the journal"
    assert fingerprint(with_regeneration(rerun, temperature=0.7)) != fingerprint(rerun), "other replies: start over"


def test_the_regenerate_cache_key_ignores_transport(tmp_path: Path) -> None:
    def key(*overrides: str) -> str:
        return stage_cache_key("regenerate", load_config(None, [f"output_dir={tmp_path}", *overrides]))

    served = ["regeneration.backend=openai", f"regeneration.base_url=[{','.join(REPLICAS)}]"]
    assert key(*served, "runtime.engines.vllm.port=8299", "regeneration.request_timeout_s=7",
               f"regeneration.base_url=[{REPLICAS[0]}]") == key(*served)
    assert key("runtime.engines.vllm.port=8299", "runtime.engines.sglang.startup_timeout_s=5") == key()
    assert key("regeneration.temperature=0.7") != key()
    assert key("runtime.engines.vllm.extra_args=[--dtype,half]") != key(), "engine numerics change replies"


def test_every_regeneration_field_is_either_a_reply_setting_or_declared_not_one() -> None:
    reads = STAGE_READS["regenerate"]
    assert reads.params == reply_fields() and reads.not_inputs == not_reply_fields()
    assert not set(reply_fields()) & set(not_reply_fields())
    assert "regeneration.temperature" in reply_fields() and "regeneration.request_timeout_s" in not_reply_fields()
    assert "runtime.engines.vllm.port" in not_reply_fields() and "runtime.engines.vllm.python" in reply_fields()
