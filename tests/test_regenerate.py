"""regenerate stage on the tiny target: local and OpenAI-compatible backends, multi-turn, reasoning, resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from contract.config import RunConfig
from contract.records import PromptRecord, read_prompt_records
from tasks import ingest, regenerate, target, validate
from tasks.data.generation import GenerationRequest
from tasks.data.generation_local import LocalGenerator
from tasks.serving.engine import free_port

from chat_server import ChatServer

TESTS = Path(__file__).resolve().parent
MULTI_TURN = {"question_id": 1, "category": "writing", "turns": ["Tell me a story about a bird.", "Now make it shorter."]}
CHATS = [
    MULTI_TURN,
    {"id": "s1", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hello, how are you?"},
                                   {"from": "gpt", "value": "old answer"}, {"from": "human", "value": "What is the capital of France?"}]},
    {"id": "s2", "conversations": [{"from": "gpt", "value": "I speak first"}, {"from": "human", "value": "hi"}]},
    {"id": "t1", "text": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"},
]


def prepare_run(tmp_path: Path, model_dir: Path, items: list[dict[str, Any]], **regeneration: Any) -> RunConfig:
    """Write the items, materialise the target and ingest: ready for regenerate."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(item) + "\n" for item in items))
    settings = {"max_new_tokens": 12, "batch_size": 4, "chunk_records": 2, "dtype": "float32", **regeneration}
    cfg = RunConfig.model_validate({
        "output_dir": str(tmp_path / "out"),
        "model": {"source": "local", "path": str(model_dir)},
        "data": {"sources": [{"name": "chats", "path": str(source)}]},
        "regeneration": settings,
        "capture": {"aux_layer_ids": [1, 2, 3]},  # the default ids repeat a layer of the 6-layer target
        "tracking": {"enabled": False},
    })
    target.run(cfg)
    ingest.run(cfg)
    return cfg


def read_regenerated(path: Path) -> list[PromptRecord]:
    """regenerated.jsonl as the stages after regenerate read it: a line that is not a record fails."""
    return [record for _, record in read_prompt_records(path)]


def by_id(path: Path) -> dict[str, PromptRecord]:
    return {record.id: record for record in read_regenerated(path)}


def test_every_assistant_turn_is_written_by_the_target(tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = prepare_run(tmp_path, tiny_target_dir, CHATS)
    result = regenerate.run(cfg)
    report = result.report
    assert (report.input, report.ok, report.error, report.skipped) == (4, 2, 1, 1)
    reasons = {outcome.id: outcome.reason for outcome in report.outcomes}
    assert "before the first user turn" in reasons["chats:s2"]
    assert "pre-templated" in reasons["chats:t1"]
    records = by_id(result.output_path)
    story = records["chats:1"]
    assert [m.role for m in story.messages] == ["user", "assistant", "user", "assistant"]
    assert [turn.turn for turn in story.generation.turns] == [1, 3]
    assert all(m.content is not None and m.supervised for m in story.messages if m.role == "assistant")
    chat = records["chats:s1"]
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.messages[2].content != "old answer", "the source's answer is replaced"
    params = chat.generation
    assert (params.backend, params.temperature, params.max_new_tokens, params.stop_tokens) == ("local", 0.0, 12, ["<|im_end|>"])
    target_info = json.loads((cfg.output_path / "target.json").read_text())
    assert (params.model_revision, params.template_hash) == (target_info["revision"], target_info["chat_template_hash"])
    assert report.metrics["tokens_per_second"] > 0
    assert not (cfg.output_path / "data" / "regenerate.journal.jsonl").exists()


def test_later_turns_see_the_regenerated_history(tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = prepare_run(tmp_path, tiny_target_dir, [MULTI_TURN])
    story = by_id(regenerate.run(cfg).output_path)["chats:1"]
    history = [{"role": m.role, "content": m.content} for m in story.messages[:3]]
    generator = LocalGenerator(cfg.output_path / "target", cfg.regeneration)
    (reply,) = generator.generate([GenerationRequest("chats:1", 3, history, 0)])
    assert reply.text == story.messages[3].content


def test_greedy_is_deterministic_and_supervise_last(tmp_path: Path, tiny_target_dir: Path) -> None:
    first = prepare_run(tmp_path / "a", tiny_target_dir, CHATS)
    second = prepare_run(tmp_path / "b", tiny_target_dir, CHATS, supervise="last", batch_size=1)
    one, two = by_id(regenerate.run(first).output_path), by_id(regenerate.run(second).output_path)
    assert [m.content for m in one["chats:1"].messages] == [m.content for m in two["chats:1"].messages]
    assert [m.supervised for m in two["chats:1"].messages if m.role == "assistant"] == [False, True]


def test_records_say_which_dtype_wrote_them(tmp_path: Path, tiny_target_dir: Path) -> None:
    """regeneration.dtype: auto resolves by the host (bfloat16 where the CPU has bf16 matrix units), an explicit
    dtype is used as given; both are written into every record and key the journal."""
    from tasks.common.host_compute import host_compute

    expected = "bfloat16" if host_compute().native_bf16_matmul else "float32"
    auto = prepare_run(tmp_path / "auto", tiny_target_dir, CHATS[:1], dtype="auto")
    half = prepare_run(tmp_path / "half", tiny_target_dir, CHATS[:1], dtype="bfloat16")
    for cfg, dtype in ((auto, expected), (half, "bfloat16")):
        result = regenerate.run(cfg)
        assert result.report.ok == 1
        assert {record.generation.dtype for record in by_id(result.output_path).values()} == {dtype}
    full = prepare_run(tmp_path / "full", tiny_target_dir, CHATS[:1])
    params = [regenerate.generation_params(cfg, json.loads((cfg.output_path / "target.json").read_text()))
              for cfg in (half, full)]
    assert [p.dtype for p in params] == ["bfloat16", "float32"]
    assert regenerate.settings_fingerprint(params[0], half) != regenerate.settings_fingerprint(params[1], full)


def test_a_record_whose_first_prompt_is_over_max_length_is_counted_and_not_sent(tmp_path: Path,
                                                                                   tiny_target_dir: Path) -> None:
    """Validate would drop it whatever the target answers, so the engine is not spent on it: it ends skipped with
    its length, every other record is written, and the journal's key changes with validation.max_length."""
    long_turn = {"id": "long", "conversations": [{"from": "human", "value": "bird " * 200},
                                                 {"from": "gpt", "value": "old"}, {"from": "human", "value": "Shorter."}]}
    cfg = prepare_run(tmp_path, tiny_target_dir, [CHATS[1], long_turn])
    cfg.validation.max_length = 128
    result = regenerate.run(cfg)
    report = result.report
    assert (report.input, report.ok, report.error, report.skipped) == (2, 1, 0, 1)
    reason = {outcome.id: outcome.reason for outcome in report.outcomes}["chats:long"]
    assert "over validation.max_length 128" in reason and "not sent" in reason
    assert report.metrics["records_over_max_length"] == 1
    assert set(by_id(result.output_path)) == {"chats:s1"}
    checked = validate.run(cfg)
    assert checked.report.input == 1 and checked.report.ok == 1
    params = regenerate.generation_params(cfg, json.loads((cfg.output_path / "target.json").read_text()))
    longer = cfg.model_copy(update={"validation": cfg.validation.model_copy(update={"max_length": 4096})})
    assert regenerate.settings_fingerprint(params, cfg) != regenerate.settings_fingerprint(params, longer)
    assert by_id(regenerate.run(longer).output_path).keys() == {"chats:s1", "chats:long"}


def test_generation_stops_at_the_targets_stop_token(tmp_path: Path, tiny_target_dir: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_target_dir, model_dir)
    probe = prepare_run(tmp_path / "probe", model_dir, [MULTI_TURN])
    generator = LocalGenerator(probe.output_path / "target", probe.regeneration)
    request = GenerationRequest("x", 1, [{"role": "user", "content": MULTI_TURN["turns"][0]}], 0)
    tokens = generator.run_generate([generator.prompt_ids(request)], 0)[0]
    stop = tokens[2]
    assert stop not in tokens[:2], "pick a probe whose third token is new"
    config = json.loads((model_dir / "generation_config.json").read_text())
    config["eos_token_id"] = [generator.tokenizer.eos_token_id, stop]
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    cfg = prepare_run(tmp_path / "run", model_dir, [MULTI_TURN])
    story = by_id(regenerate.run(cfg).output_path)["chats:1"]
    first_turn = story.generation.turns[0]
    assert (first_turn.finish_reason, first_turn.completion_tokens) == ("stop", 3)
    assert story.messages[1].content == generator.tokenizer.decode(tokens[:2], skip_special_tokens=True)


def stage_command(config: Path) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "stage", "regenerate", "--config", str(config)]


def journal_keys(path: Path) -> list[str]:
    """The record keys a journal holds, in commit order (not its fingerprint line, not the lines naming a server,
    not a last line still being written)."""
    lines = path.read_bytes().splitlines(keepends=True)[1:] if path.exists() else []
    entries = [json.loads(line) for line in lines if line.endswith(b"\n")]
    return [entry["key"] for entry in entries if "key" in entry]


def journal_entries(path: Path) -> int:
    return len(journal_keys(path))


@pytest.mark.integration
def test_kill_9_then_rerun_loses_and_duplicates_nothing(tmp_path: Path, tiny_target_dir: Path) -> None:
    items = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me a story number {i}."}]} for i in range(24)]
    cfg = prepare_run(tmp_path / "killed", tiny_target_dir, items, max_new_tokens=48, chunk_records=2, batch_size=2)
    config = tmp_path / "killed.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    journal = cfg.output_path / "data" / "regenerate.journal.jsonl"
    process = subprocess.Popen(stage_command(config), cwd=TESTS.parent, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while journal_entries(journal) < 4 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    committed = journal_entries(journal)
    assert 4 <= committed < 24, f"the kill must land mid-run (journal had {committed} entries)"
    assert not (cfg.output_path / "data" / "regenerated.jsonl").exists()
    with open(journal, "ab") as handle:
        handle.write(b'{"key": "prompts.jsonl:99", "outc')  # a write cut short by the kill

    resumed = regenerate.run(cfg)
    straight_cfg = prepare_run(tmp_path / "straight", tiny_target_dir, items, max_new_tokens=48, chunk_records=2, batch_size=2)
    straight = regenerate.run(straight_cfg)
    resumed_lines = resumed.output_path.read_text().splitlines()
    assert len(resumed_lines) == len(set(resumed_lines)) == 24
    assert [record.id for record in read_regenerated(resumed.output_path)] == [f"chats:c{i}" for i in range(24)]
    assert by_id(resumed.output_path).keys() == by_id(straight.output_path).keys()
    assert [r.messages for r in by_id(resumed.output_path).values()] == [r.messages for r in by_id(straight.output_path).values()]
    assert (resumed.report.input, resumed.report.ok) == (24, 24)
    assert resumed.report.metrics["completion_tokens"] < straight.report.metrics["completion_tokens"], "resume redid only the rest"


def test_a_journal_for_other_settings_is_not_resumed(tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = prepare_run(tmp_path, tiny_target_dir, [MULTI_TURN])
    journal = cfg.output_path / "data" / "regenerate.journal.jsonl"
    journal.write_text(json.dumps({"fingerprint": "other"}) + "\n" + json.dumps({"key": "prompts.jsonl:1", "outcome": {}}) + "\n")
    result = regenerate.run(cfg)
    assert result.report.ok == 1 and by_id(result.output_path)["chats:1"].generation is not None


# ------------------------------------------------------------------------- OpenAI-compatible backend


@pytest.fixture
def serve_tiny(tiny_target_dir: Path, subprocesses: None) -> Iterator:
    servers: list[ChatServer] = []

    def start(*options: str, port: int | None = None, model_dir: Path | None = None) -> ChatServer:
        server = ChatServer(model_dir or tiny_target_dir, port or free_port(), *options)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def openai_run(tmp_path: Path, model_dir: Path, url: str, items=CHATS[:2], **regeneration: Any) -> RunConfig:
    settings = {"backend": "openai", "base_url": url, "backoff_initial_s": 0.05, "backoff_max_s": 0.5, **regeneration}
    return prepare_run(tmp_path, model_dir, items, **settings)


def test_openai_backend_matches_the_local_backend(tmp_path: Path, tiny_target_dir: Path, serve_tiny) -> None:
    server = serve_tiny()
    remote = regenerate.run(openai_run(tmp_path / "remote", tiny_target_dir, server.url, concurrency=3))
    local = regenerate.run(prepare_run(tmp_path / "local", tiny_target_dir, CHATS[:2]))
    assert remote.report.ok == 2
    remote_records, local_records = by_id(remote.output_path), by_id(local.output_path)
    for record_id, record in local_records.items():
        assert [m.content for m in remote_records[record_id].messages] == [m.content for m in record.messages]
    assert remote_records["chats:1"].generation.backend == f"openai:{server.url}"


def test_transient_errors_are_retried_and_bad_requests_are_not(tmp_path: Path, tiny_target_dir: Path, serve_tiny) -> None:
    throttled = serve_tiny("--fail-first", "3", "--fail-status", "429")
    result = regenerate.run(openai_run(tmp_path / "throttled", tiny_target_dir, throttled.url, concurrency=1))
    assert result.report.ok == 2 and throttled.chat_requests() == 3 + 4, "3 refusals, then 4 turns answered"
    rejecting = serve_tiny("--fail-first", "100", "--fail-status", "400")
    refused = regenerate.run(openai_run(tmp_path / "refused", tiny_target_dir, rejecting.url, max_retries=4))
    assert refused.report.error == 2 and rejecting.chat_requests() == 2, "a 400 is sent once"
    assert all("not retried, HTTP 400" in outcome.reason for outcome in refused.report.outcomes)
    failing = serve_tiny("--fail-first", "100", "--fail-status", "503")
    gave_up = regenerate.run(openai_run(tmp_path / "gave-up", tiny_target_dir, failing.url, max_retries=2, concurrency=1))
    assert gave_up.report.error == 2 and failing.chat_requests() == 2 * 3
    assert "gave up after 3 attempts, last: HTTP 503" in gave_up.report.outcomes[0].reason


def test_a_server_refusing_most_requests_stops_the_stage_early(tmp_path: Path, tiny_target_dir: Path,
                                                               serve_tiny) -> None:
    prompts = [f"Question {n}?" for n in range(40)]
    refusal = "The model `test-target` does not exist."
    refusing = {prompt: {"content": f"Answer {n}."} if n < 2 else {"status": 404, "message": refusal}
                for n, prompt in enumerate(prompts)}
    (tmp_path / "refusing.json").write_text(json.dumps(refusing))
    port = free_port()
    server = serve_tiny("--scripted", str(tmp_path / "refusing.json"), port=port)
    items = [{"id": f"q{n}", "messages": [{"role": "user", "content": prompt}]} for n, prompt in enumerate(prompts)]
    cfg = openai_run(tmp_path / "run", tiny_target_dir, server.url, items, concurrency=2, chunk_records=1)
    with pytest.raises(regenerate.ServerRefusedError) as raised:
        regenerate.run(cfg)
    message = str(raised.value)
    assert f"{server.url}/chat/completions refused" in message and "HTTP 404" in message and refusal in message
    assert server.chat_requests() <= 2 + regenerate.REFUSAL_STREAK + 1, "it stopped after a few of the 40 requests"
    journal = cfg.output_path / "data" / "regenerate.journal.jsonl"
    kept = journal_keys(journal)
    # two records are in flight at once, so they are journalled in the order they finish
    assert sorted(kept) == ["prompts.jsonl:1", "prompts.jsonl:2"], "the answered records stay; the refused ones are not kept"
    assert not (cfg.output_path / "data" / "regenerated.jsonl").exists()

    server.stop()
    answering = {prompt: {"content": f"Answer {n}."} for n, prompt in enumerate(prompts)}
    answering[prompts[20]] = {"status": 400, "message": "this one prompt is rejected"}
    (tmp_path / "answering.json").write_text(json.dumps(answering))
    fixed = serve_tiny("--scripted", str(tmp_path / "answering.json"), port=port)
    resumed = regenerate.run(cfg)
    assert fixed.chat_requests() == 38, "the resume sends the refused records again, not the kept ones"
    assert (resumed.report.ok, resumed.report.error) == (39, 1), "an occasional refusal is that record's error"
    (error,) = [outcome for outcome in resumed.report.outcomes if outcome.status == "error"]
    assert error.id == "chats:q20" and "not retried, HTTP 400" in error.reason
    assert "this one prompt is rejected" in error.reason


def scripted_replies(tmp_path: Path, prompts: list[str], delay_s: float) -> Path:
    replies = {prompt: {"content": f"Answer to {prompt}", "delay_s": delay_s} for prompt in prompts}
    path = tmp_path / "replies.json"
    path.write_text(json.dumps(replies))
    return path


def test_replicas_share_the_requests_and_a_dead_one_fails_over(tmp_path: Path, tiny_target_dir: Path,
                                                                serve_tiny) -> None:
    """Two replicas, two requests in flight on each; one is killed mid-run: its requests go to the other and every
    id ends exactly once."""
    prompts = [f"Replica question {n}?" for n in range(24)]
    replies = scripted_replies(tmp_path, prompts, delay_s=0.2)
    first, second = serve_tiny("--scripted", str(replies)), serve_tiny("--scripted", str(replies))
    items = [{"id": f"r{n}", "messages": [{"role": "user", "content": prompt}]} for n, prompt in enumerate(prompts)]
    cfg = openai_run(tmp_path / "run", tiny_target_dir, [first.url, second.url], items, concurrency=2,
                     chunk_records=4, max_retries=3)
    outcome: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: outcome.update(result=regenerate.run(cfg)))
    runner.start()
    deadline = time.monotonic() + 60
    while first.chat_requests() < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    first_stats = first.stats()
    first.stop()
    runner.join(timeout=120)
    result = outcome["result"]

    assert (result.report.ok, result.report.error) == (24, 0), [o.reason for o in result.report.outcomes if o.reason]
    records = by_id(result.output_path)
    assert sorted(records) == sorted(f"chats:r{n}" for n in range(24)), "every id once"
    assert all(record.messages[-1].content == f"Answer to {record.messages[0].content}" for record in records.values())
    assert records["chats:r0"].generation.backend == f"openai:{first.url},{second.url}"
    metrics = result.report.metrics
    assert metrics["endpoint_0_replies"] + metrics["endpoint_1_replies"] == 24
    assert metrics["endpoint_0_replies"] >= 2 and metrics["endpoint_1_replies"] >= 12, "both took requests"
    assert metrics["endpoint_0_failures"] >= 1 and metrics["endpoint_failovers"] >= 1, "the dead one failed over"
    assert first_stats["max_in_flight"] <= 2 and second.stats()["max_in_flight"] <= 2, "concurrency per endpoint"


def test_a_replica_down_at_the_start_is_left_aside(tmp_path: Path, tiny_target_dir: Path, serve_tiny) -> None:
    prompts = [f"Question {n}?" for n in range(6)]
    live = serve_tiny("--scripted", str(scripted_replies(tmp_path, prompts, delay_s=0.0)))
    dead = f"http://127.0.0.1:{free_port()}/v1"
    items = [{"id": f"q{n}", "messages": [{"role": "user", "content": prompt}]} for n, prompt in enumerate(prompts)]
    result = regenerate.run(openai_run(tmp_path / "run", tiny_target_dir, [dead, live.url], items, concurrency=2))
    assert (result.report.ok, result.report.metrics["endpoint_1_replies"]) == (6, 6)
    assert live.chat_requests() == 6
    with pytest.raises(ValueError, match="endpoints listed twice"):
        RunConfig.model_validate({"regeneration": {"backend": "openai", "base_url": [live.url, live.url]}})


def test_server_stopped_mid_run_is_waited_for(tmp_path: Path, tiny_target_dir: Path, serve_tiny) -> None:
    port = free_port()
    server = serve_tiny(port=port)
    items = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Story {i}"}]} for i in range(8)]
    cfg = openai_run(tmp_path, tiny_target_dir, server.url, items, concurrency=1, chunk_records=1,
                     max_retries=8, backoff_initial_s=0.5, backoff_max_s=2.0)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    runner = subprocess.Popen(stage_command(config), cwd=TESTS.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    journal = cfg.output_path / "data" / "regenerate.journal.jsonl"
    deadline = time.monotonic() + 120
    while journal_entries(journal) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.stop()
    time.sleep(1.0)
    serve_tiny(port=port)
    _, stderr = runner.communicate(timeout=300)
    assert runner.returncode == 0, stderr.decode()[-2000:]
    report = json.loads((cfg.output_path / "data" / "regenerate_report.json").read_text())
    assert (report["input"], report["ok"]) == (8, 8)


def test_reasoning_modes(tmp_path: Path, tiny_target_dir: Path, serve_tiny) -> None:
    script = {
        "think tags": {"content": "<think>step one</think>The answer."},
        "server field": {"content": "Answer two.", "reasoning_content": "thought"},
        "unclosed": {"content": "<think>never closed"},
    }
    (tmp_path / "script.json").write_text(json.dumps(script))
    server = serve_tiny("--scripted", str(tmp_path / "script.json"))
    items = [{"id": key.replace(" ", "-"), "messages": [{"role": "user", "content": key}]} for key in script]
    saved = regenerate.run(openai_run(tmp_path / "save", tiny_target_dir, server.url, items, reasoning="save"))
    records = by_id(saved.output_path)
    tagged, fielded = records["chats:think-tags"].messages[1], records["chats:server-field"].messages[1]
    assert (tagged.content, tagged.reasoning_content) == ("The answer.", "step one")
    assert (fielded.content, fielded.reasoning_content) == ("Answer two.", "thought")
    reasons = {outcome.id: outcome.reason for outcome in saved.report.outcomes}
    assert saved.report.error == 1 and "unclosed <think>" in reasons["chats:unclosed"]
    off = regenerate.run(openai_run(tmp_path / "off", tiny_target_dir, server.url, items, reasoning="off"))
    assert (off.report.ok, off.report.error) == (0, 3)
    assert all("regeneration.reasoning is 'off'" in outcome.reason for outcome in off.report.outcomes)


def test_records_stream_so_a_slow_turn_does_not_hold_back_other_records(tmp_path: Path, tiny_target_dir: Path,
                                                                        serve_tiny) -> None:
    # Rounds would send slow-2 together with fast-2, after slow-1 returns; streaming sends fast-2 and fast-3
    # while slow-1 is still being answered.
    script = {f"{speed}-{turn}": {"content": f"{speed} answer {turn}.", "delay_s": 1.5 if speed == "slow" else 0.0}
              for speed in ("slow", "fast") for turn in (1, 2, 3)}
    (tmp_path / "script.json").write_text(json.dumps(script))
    server = serve_tiny("--scripted", str(tmp_path / "script.json"))
    items = [{"id": speed, "messages": [message for turn in (1, 2, 3) for message in
                                        ({"role": "user", "content": f"{speed}-{turn}"}, {"role": "assistant", "content": "old"})]}
             for speed in ("slow", "fast")]
    result = regenerate.run(openai_run(tmp_path / "run", tiny_target_dir, server.url, items, concurrency=2, chunk_records=8))
    assert result.report.ok == 2
    arrivals = server.arrivals()
    assert sorted(arrivals) == sorted(script), "each turn is sent exactly once"
    assert arrivals.index("fast-3") < arrivals.index("slow-2"), arrivals
    written = by_id(result.output_path)["chats:slow"].messages
    assert [message.content for message in written if message.role == "assistant"] == [f"slow answer {turn}." for turn in (1, 2, 3)]


def test_journal_entries_are_reused_only_for_unchanged_records(tmp_path: Path, tiny_target_dir: Path) -> None:
    items = [{"id": "a", "messages": [{"role": "user", "content": "Hello there."}]},
             {"id": "b", "messages": [{"role": "user", "content": "Tell me a story."}]}]
    cfg = prepare_run(tmp_path, tiny_target_dir, items, chunk_records=1)
    data = cfg.output_path / "data"
    records = regenerate.read_prompts(data / "prompts.jsonl")
    params = regenerate.generation_params(cfg, json.loads((cfg.output_path / "target.json").read_text()))
    journal = regenerate.Journal(data / "regenerate.journal.jsonl", regenerate.settings_fingerprint(params, cfg))
    journal.load()
    generator = LocalGenerator(cfg.output_path / "target", cfg.regeneration)
    stats = {"completion_tokens": 0.0, "generation_seconds": 0.0, "records": 0.0}
    journal.commit(regenerate.regenerate_chunk(records, generator, cfg, params, stats))
    items[1]["messages"][0]["content"] = "Tell me a different story."
    ingest.run(prepare_run(tmp_path, tiny_target_dir, items, chunk_records=1))
    result = regenerate.run(cfg)
    fresh = prepare_run(tmp_path / "fresh", tiny_target_dir, items[1:])
    assert result.report.ok == 2
    assert result.report.metrics["completion_tokens"] == regenerate.run(fresh).report.metrics["completion_tokens"]
    assert by_id(result.output_path)["chats:b"].messages[0].content == "Tell me a different story."
