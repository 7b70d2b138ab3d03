"""The openai backend against a real vLLM CPU server (`make serve-env`), started by the stage or by the test."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tasks import regenerate
from tasks.serving.engine import EngineLaunch, free_port, serve
from test_regenerate import by_id, journal_entries, prepare_run, read_regenerated, stage_command

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"

# Single turns: a later turn's prompt holds the earlier answer's text, and the random tiny model's
# byte-level pieces decode differently at a cut (see complete_text), which would fork the history.
SINGLE_TURN = [{"id": key, "messages": [{"role": "user", "content": text}]}
               for key, text in [("a", "Tell me a story about a bird."), ("b", "What is the capital of France?")]]


@pytest.fixture(autouse=True)
def vllm_environment(vllm_python: Path) -> None:
    """Every test here starts the stage's vLLM engine (the engine tier; conftest fails them without the venv)."""


def complete_text(text: str | None) -> str | None:
    return text.rstrip("\ufffd") if text is not None else None


def test_stage_starts_vllm_and_matches_the_local_backend(tmp_path: Path, tiny_target_dir: Path) -> None:
    port = free_port()
    served = prepare_run(tmp_path / "vllm", tiny_target_dir, SINGLE_TURN, backend="openai", engine="vllm", concurrency=4,
                         engine_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    served.runtime.engines["vllm"].port = port
    result = regenerate.run(served)
    local = regenerate.run(prepare_run(tmp_path / "local", tiny_target_dir, SINGLE_TURN))
    assert result.report.ok == 2
    remote_records, local_records = by_id(result.output_path), by_id(local.output_path)
    for record_id, record in local_records.items():
        remote = remote_records[record_id]
        # The random tiny model emits byte-level pieces; when a turn ends on a partial UTF-8 character
        # vLLM's detokenizer holds the incomplete tail back while transformers prints U+FFFD for it.
        assert [complete_text(m.content) for m in remote.messages] == [complete_text(m.content) for m in record.messages]
        assert [turn.completion_tokens for turn in remote.generation.turns] == [turn.completion_tokens for turn in record.generation.turns]
    assert remote_records["chats:a"].generation.backend == "openai:vllm"
    assert remote_records["chats:a"].generation.dtype == "float32", "regeneration.dtype reached the record"
    log = (served.output_path / "logs" / "regenerate-vllm.log").read_text()
    assert "vllm.entrypoints.openai.api_server" in log
    assert "reserved_cpus=[]" in log, "regeneration.engine_env reached the engine (no core held back)"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)


def test_vllm_stopped_mid_run_then_restarted(tmp_path: Path, tiny_target_dir: Path) -> None:
    port = free_port()
    launch = EngineLaunch(kind="vllm", model=tiny_target_dir, python=str(VLLM_PYTHON), port=port,
                          log_path=tmp_path / "logs" / "vllm.log", env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    items = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me story {i}."}]} for i in range(12)]
    with serve(launch) as engine:
        cfg = prepare_run(tmp_path, tiny_target_dir, items, backend="openai", base_url=engine.base_url, concurrency=1,
                          served_model_name=launch.served_model_name, chunk_records=1, max_new_tokens=32,
                          max_retries=14, backoff_initial_s=1.0, backoff_max_s=8.0)
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        runner = subprocess.Popen(stage_command(config), cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        journal = cfg.output_path / "data" / "regenerate.journal.jsonl"
        deadline = time.monotonic() + 300
        while journal_entries(journal) < 2 and runner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        engine.stop()
    done_before_restart = journal_entries(journal)
    with serve(launch):
        _, stderr = runner.communicate(timeout=600)
    assert runner.returncode == 0, stderr.decode()[-3000:]
    assert done_before_restart < 12, "the server went down while records were still pending"
    report = json.loads((cfg.output_path / "data" / "regenerate_report.json").read_text())
    assert (report["input"], report["ok"], report["error"]) == (12, 12, 0)
    assert [record.id for record in read_regenerated(cfg.output_path / "data" / "regenerated.jsonl")] == [f"chats:c{i}" for i in range(12)]
