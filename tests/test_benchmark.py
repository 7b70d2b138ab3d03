"""benchmark stage: the streaming client and its statistics, the speculative counters and checks, and one
real benchmark on the vLLM CPU build (`make serve-env`) with a drafter trained on the tiny target.

The fast tests stream from a scripted SSE server in this process (known chunk delays, optional usage, failures),
feed the counter arithmetic the exact /metrics series vLLM 0.32 writes, and run the stage over canned
measurements. The engine-tier tests train a drafter on the very text the target generates greedily, so the engine
accepts its drafts, serves it on vLLM, and checks the engine's acceptance against the offline estimate.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Iterator, Optional

import pytest

from config_reads import ConfigReads
from contract.config import RunConfig
from contract.records import PromptRecord
from in_process_server import InProcessServer
from flows.stages import NOT_INPUTS, STAGE_READS
from report_builders import acceptance_report, mode_acceptance
from tasks import benchmark
from tasks.serving import spec_counters
from tasks.serving.engine import free_port, parse_prometheus
from tasks.serving.client import (ChatRequest, RequestResult, Sampling, distribution_ms, percentile, run_level,
                                  stream_chat, summarize_level, time_per_output_token)

REPO_ROOT = Path(__file__).resolve().parent.parent


# --- statistics -----------------------------------------------------------------------------------------


def test_percentiles_interpolate_linearly_like_numpy() -> None:
    import numpy

    samples = [[5.0], [3.0, 1.0], [0.1, 0.5, 0.2, 0.9, 0.7], [float(i) for i in range(101)], [2.0, 2.0, 8.0, 1.0]]
    for values in samples:
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(numpy.percentile(values, q)), (values, q)
    assert percentile([10.0, 20.0], 50) == 15.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_tpot_excludes_the_first_token() -> None:
    assert time_per_output_token(latency_s=2.0, ttft_s=0.5, output_tokens=4) == pytest.approx(0.5)
    assert time_per_output_token(latency_s=2.0, ttft_s=0.5, output_tokens=1) is None, "no second token"
    assert time_per_output_token(latency_s=None, ttft_s=0.5, output_tokens=4) is None


def test_a_level_summary_counts_tokens_over_wall_time_and_reports_milliseconds() -> None:
    results = [
        RequestResult(index=0, prompt_id="a", output_tokens=11, content_chunks=10, ttft_s=0.1, latency_s=1.1,
                      itl_s=[0.1] * 9),
        RequestResult(index=1, prompt_id="b", output_tokens=21, content_chunks=20, ttft_s=0.3, latency_s=2.3,
                      itl_s=[0.2] * 19),
        RequestResult(index=2, prompt_id="c", error="HTTP 500: boom"),
    ]
    level = summarize_level(results, wall_s=4.0)
    assert (level["requests"], level["completed"], level["failed"]) == (3, 2, 1)
    assert level["output_tokens"] == 32 and level["output_tokens_per_s"] == 8.0
    assert level["requests_per_s"] == 0.5 and level["tokens_per_chunk"] == pytest.approx(32 / 30)
    assert level["ttft_ms"]["mean"] == pytest.approx(200.0) and level["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert level["tpot_ms"]["p50"] == pytest.approx(100.0)  # (1.1-0.1)/10 = 0.1, (2.3-0.3)/20 = 0.1
    assert level["itl_ms"]["p90"] == pytest.approx(200.0) and level["latency_ms"]["p99"] == pytest.approx(2288.0)
    assert distribution_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


# --- the streaming client against a scripted server ----------------------------------------------------


class ScriptedServer(InProcessServer):
    """An OpenAI-style SSE server: a role chunk, then `pieces` one per `gap_s` after `first_s`, then usage.

    A user message "fail" answers HTTP 500; "no-usage" leaves the usage chunk out. It records how many
    requests were in flight at once.
    """

    def __init__(self, pieces: list[str], first_s: float, gap_s: float) -> None:
        self.pieces, self.first_s, self.gap_s = pieces, first_s, gap_s
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        super().__init__()
        self.base_url = f"{self.root_url}/v1"

    def handler(self) -> type[BaseHTTPRequestHandler]:
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                return None

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                scripted.bodies.append(body)
                prompt = body["messages"][-1]["content"]
                if prompt == "fail":
                    self.send_response(500)
                    self.send_header("Content-Length", "4")
                    self.end_headers()
                    self.wfile.write(b"boom")
                    return
                if prompt == "fail-in-stream":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.event({"error": {"message": "Token id 200008 is out of vocabulary", "code": 400}})
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                    return
                with scripted.lock:
                    scripted.in_flight += 1
                    scripted.max_in_flight = max(scripted.max_in_flight, scripted.in_flight)
                try:
                    self.stream(prompt != "no-usage")
                finally:
                    with scripted.lock:
                        scripted.in_flight -= 1

            def stream(self, usage: bool) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                self.event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                time.sleep(scripted.first_s)
                for number, piece in enumerate(scripted.pieces):
                    if number:
                        time.sleep(scripted.gap_s)
                    self.event({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
                self.event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
                if usage:
                    self.event({"choices": [], "usage": {"completion_tokens": 2 * len(scripted.pieces)}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def event(self, chunk: dict[str, Any]) -> None:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()

        return Handler


@pytest.fixture
def scripted(scripted_server: None) -> Iterator[ScriptedServer]:
    with ScriptedServer(["Hello", " there", " friend", "!"], first_s=0.2, gap_s=0.05) as server:
        yield server


def request(index: int, content: str) -> ChatRequest:
    return ChatRequest(index=index, prompt_id=f"p{index}", messages=[{"role": "user", "content": content}])


async def one_request(base_url: str, chat: ChatRequest) -> RequestResult:
    import httpx

    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        return await stream_chat(client, base_url, "target", chat, Sampling(temperature=0.0, max_tokens=8))


def test_a_streamed_request_is_timed_per_content_chunk(scripted: ScriptedServer) -> None:
    result = asyncio.run(one_request(scripted.base_url, request(0, "hi")))
    assert result.ok and result.text == "Hello there friend!"
    assert result.output_tokens == 8 and result.usage_reported, "tokens come from usage, not from chunks"
    assert result.content_chunks == 4 and len(result.itl_s) == 3, "the empty role chunk is not a token"
    # Only what causality guarantees (the server waits 0.2 s, then 0.05 s between pieces); a loaded client may
    # read two pieces at once, so single gaps have no lower bound.
    assert result.ttft_s >= 0.2 and all(gap >= 0.0 for gap in result.itl_s)
    assert result.latency_s >= 0.2 + 3 * 0.05
    assert result.latency_s >= result.ttft_s + sum(result.itl_s) - 1e-6
    assert result.tpot_s == pytest.approx((result.latency_s - result.ttft_s) / 7)
    assert result.finish_reason == "length"
    body = scripted.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["max_tokens"] == 8 and "ignore_eos" not in body


def test_without_usage_tokens_are_counted_as_chunks_and_failures_are_results(scripted: ScriptedServer) -> None:
    plain = asyncio.run(one_request(scripted.base_url, request(0, "no-usage")))
    assert plain.ok and plain.output_tokens == 4 and not plain.usage_reported
    failed = asyncio.run(one_request(scripted.base_url, request(1, "fail")))
    assert not failed.ok and failed.error.startswith("HTTP 500") and failed.latency_s is None
    in_stream = asyncio.run(one_request(scripted.base_url, request(2, "fail-in-stream")))
    assert in_stream.error == "error in the stream: Token id 200008 is out of vocabulary", "not 0 tokens and ok"


def test_a_level_keeps_at_most_concurrency_requests_in_flight(scripted: ScriptedServer) -> None:
    chats = [request(index, f"question {index}") for index in range(5)]
    results, wall_s = asyncio.run(run_level(scripted.base_url, "target", chats, Sampling(0.0, 8), concurrency=2))
    assert [result.index for result in results] == list(range(5)), "results come back in request order"
    assert all(result.ok for result in results)
    assert scripted.max_in_flight == 2
    assert wall_s >= 3 * 0.35, "five requests of >= 0.35 s, two at a time: at least three rounds"


# --- prompts, counters and checks -----------------------------------------------------------------------


def prompt_record(record_id: str, messages: list[dict[str, Any]] | None = None,
                  text: str | None = None, source: str = "s") -> PromptRecord:
    return PromptRecord.model_validate({"id": record_id, "source": source, "messages": messages or [], "text": text,
                                        "provenance": {"file": "eval.jsonl", "line": 1, "format": "openai"}})


def test_requests_are_the_supervised_turns_cycled_to_the_requested_count() -> None:
    records = [
        prompt_record("s:1", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"},
                              {"role": "assistant", "content": "Fine"}]),
        prompt_record("s:2", text="<|im_start|>user\nraw<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"),
        prompt_record("s:3", [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "So."}]),
    ]
    requests = benchmark.build_requests(records, 5)
    assert [chat.prompt_id for chat in requests] == ["s:1#turn1", "s:1#turn2", "s:3#turn1", "s:1#turn1", "s:1#turn2"]
    assert [chat.index for chat in requests] == list(range(5))
    assert requests[0].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert requests[1].messages[-2:] == [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    with pytest.raises(ValueError, match="none of the 1 eval records"):
        benchmark.build_requests([records[1]], 3)


VLLM_METRICS = """\
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="target"}} {drafts}
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="target"}} {draft_tokens}
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="target"}} {accepted}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="target",position="0"}} {pos0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="target",position="1"}} {pos1}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="target",position="2"}} {pos2}
vllm:spec_decode_num_accepted_tokens_per_pos_created{{engine="0",model_name="target",position="0"}} 1.7e9
"""


def vllm_metrics(**values: float) -> dict[str, float]:
    return parse_prometheus(VLLM_METRICS.format(**values))


def test_vllm_acceptance_comes_from_counter_differences() -> None:
    before = vllm_metrics(drafts=42, draft_tokens=126, accepted=5, pos0=5, pos1=0, pos2=0)
    after = vllm_metrics(drafts=52, draft_tokens=156, accepted=20, pos0=12, pos1=6, pos2=2)
    window = spec_counters.speculative_window("vllm", before, after)
    assert window == {"drafts": 10, "draft_tokens": 30, "accepted": 15, "accepted_per_position": [7, 6, 2]}
    numbers = spec_counters.acceptance("vllm", window)
    assert numbers["mean_accept_length"] == pytest.approx(2.5), "15 accepted over 10 drafts, plus the bonus token"
    assert numbers["draft_acceptance_rate"] == pytest.approx(0.5)
    assert numbers["acceptance_rate_per_position"] == pytest.approx([0.7, 0.6, 0.2])
    idle = spec_counters.speculative_window("vllm", after, after)
    assert spec_counters.acceptance("vllm", idle)["mean_accept_length"] is None

    levels = [{"speculative": {"window": window}}, {"speculative": {"window": idle}}]
    overall = spec_counters.overall_acceptance("vllm", levels)
    assert overall["mean_accept_length"] == pytest.approx(2.5)


class CountingEngine:
    """A drafting engine's counters as vLLM 0.32 writes them: each completed prompt adds its scripted drafts and
    accepted tokens (prompt id -> (drafts, accepted at positions 1..3, completion tokens))."""

    def __init__(self, script: dict[int, tuple[int, tuple[int, int, int], int]]) -> None:
        self.script = script
        self.totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "pos0": 0, "pos1": 0, "pos2": 0}

    def read_metrics(self) -> dict[str, float]:
        return vllm_metrics(**self.totals)

    def complete(self, prompt: Any) -> dict[str, Any]:
        drafts, accepted, emitted = self.script[prompt.input_ids[0]]
        self.totals["drafts"] += drafts
        self.totals["draft_tokens"] += 3 * drafts
        self.totals["accepted"] += sum(accepted)
        for position, count in enumerate(accepted):
            self.totals[f"pos{position}"] += count
        return {"choices": [{"text": "..."}], "usage": {"completion_tokens": emitted}}


def test_suites_replay_in_units_of_one_category_and_count_each_units_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.data.held_out import EvalPrompt
    from tasks.serving import counted_completions, suite_replay

    categories = ["writing", "math", "writing", "math", "writing", "-"]
    prompts = [EvalPrompt(f"mtbench:{index}", 1, "mtbench" if index < 5 else "gsm8k", category, [index, 7])
               for index, category in enumerate(categories)]
    units = suite_replay.replay_units(prompts, concurrency=2)
    assert [unit.key for unit in units] == ["mtbench:0#turn1+mtbench:2#turn1", "mtbench:4#turn1",
                                            "mtbench:1#turn1+mtbench:3#turn1", "mtbench:5#turn1"]
    assert [len(unit.prompts) for unit in suite_replay.replay_units(prompts, concurrency=1)] == [1] * 6

    script = {0: (10, (5, 2, 1), 20), 1: (8, (0, 0, 0), 8), 2: (6, (6, 6, 3), 24), 3: (4, (1, 0, 0), 5),
              4: (5, (2, 1, 0), 9), 5: (9, (4, 4, 4), 30)}
    engine = CountingEngine(script)

    async def scripted(_engine: Any, unit_prompts: Any, max_tokens: int, temperature: float) -> list[dict[str, Any]]:
        assert (max_tokens, temperature) == (32, 0.0)
        return [engine.complete(prompt) for prompt in unit_prompts]

    monkeypatch.setattr(counted_completions, "complete_all", scripted)
    replay = suite_replay.replay_suites(engine, "vllm", units, 32, 0.0)
    rows = replay["rows"]
    assert [(row["rounds"], row["accepted_per_position"], row["generated_tokens"]) for row in rows] == [
        (16, [11, 8, 4], 44), (5, [2, 1, 0], 9), (12, [1, 0, 0], 13), (9, [4, 4, 4], 30)]
    assert rows[0]["input_hash"] == units[0].input_hash != suite_replay.replay_units(prompts, 1)[0].input_hash

    summary = suite_replay.suites_summary("vllm", replay, units, steps=3, max_tokens=32, temperature=0.0,
                                          concurrency=2)
    assert summary["unit"] == "groups of up to 2 prompts" and summary["prompts"] == 6 and summary["rounds"] == 42
    assert summary["mean_accept_length"] == pytest.approx(1 + 39 / 42)
    assert summary["acceptance_by_position"] == pytest.approx([18 / 42, 13 / 42, 8 / 42])
    writing = summary["buckets"]["category=writing"]
    assert writing["prompts"] == 2 and writing["mean_accept_length"] == pytest.approx(1 + (23 + 3) / 21)
    assert summary["buckets"]["source=gsm8k"]["prompts"] == 1 and "turn=1" not in summary["buckets"], \
        "a group shares its suite and category only"


def test_agreement_reads_the_reference_prompts_the_suite_replay_sent_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default's reference prompts are a subset of its MT-bench suite: one request each, not two."""
    from tasks.data.held_out import EvalPrompt
    from tasks.serving import counted_completions, suite_replay
    from tasks.serving.agreement import run_agreement

    suite = [EvalPrompt(f"mtbench:{index}", 1, "mtbench", "writing", [index, 7]) for index in range(4)]
    outside = EvalPrompt("mtbench:9", 1, "mtbench", "math", [9, 7])
    engine = CountingEngine({0: (10, (5, 2, 1), 20), 1: (8, (0, 0, 0), 8), 2: (6, (6, 3, 1), 24),
                             3: (4, (1, 0, 0), 5), 9: (7, (3, 1, 0), 12)})
    sent: list[int] = []

    async def scripted(_engine: Any, unit_prompts: Any, max_tokens: int, temperature: float) -> list[dict[str, Any]]:
        sent.extend(prompt.input_ids[0] for prompt in unit_prompts)
        return [engine.complete(prompt) for prompt in unit_prompts]

    monkeypatch.setattr(counted_completions, "complete_all", scripted)
    memo = counted_completions.CountedMemo()
    replay = suite_replay.replay_suites(engine, "vllm", suite_replay.replay_units(suite, 1), 32, 0.0, memo)
    rows = run_agreement(engine, "vllm", [suite[2], outside, suite[0]], 32, 0.0, memo)
    assert sent == [0, 1, 2, 3, 9], "only the prompt outside the suites is generated again"
    assert [(row["drafts"], row["accepted_per_position"], row["from_suite_replay"]) for row in rows] == [
        (6, [6, 3, 1], True), (7, [3, 1, 0], False), (10, [5, 2, 1], True)]
    assert replay["rows"][2]["accepted_per_position"] == rows[0]["accepted_per_position"]
    other_budget = run_agreement(engine, "vllm", [suite[1]], 16, 0.0, memo)
    assert sent[-1] == 1 and other_budget[0]["from_suite_replay"] is False, "another budget is another request"


def test_sglang_acceptance_comes_from_its_gauges() -> None:
    metrics = parse_prometheus(
        'sglang:spec_accept_length{dp_rank="0",model_name="m",tp_rank="0"} 2.5\n'
        'sglang:spec_accept_length{dp_rank="0",model_name="m",tp_rank="1"} 2.7\n'
        'sglang:spec_accept_rate{dp_rank="0",model_name="m",tp_rank="0"} 0.5\n'
    )
    window = spec_counters.speculative_window("sglang", {}, metrics)
    assert window["accept_length"] == pytest.approx(2.6) and window["accept_rate"] == 0.5
    assert spec_counters.acceptance("sglang", window)["mean_accept_length"] == pytest.approx(2.6)
    assert benchmark.drafting_check("sglang", {"mean_accept_length": None, "window": {}}) is not None


def offline_run(tmp_path: Path, rounds: int = 226, accepted: tuple[float, ...] = (8, 8, 8), steps: int = 3) -> RunConfig:
    """A run dir with an offline evaluation (per-position counts, one prompt) and a vLLM export whose layer ids the
    message should quote."""
    (tmp_path / "evaluate").mkdir(parents=True, exist_ok=True)
    per_prompt = [{"prompt": "mtbench:81#turn1", "rounds": rounds, "accepted_per_position": list(accepted),
                   "generated_tokens": 32}]
    chain = mode_acceptance(steps, rounds, list(accepted), per_prompt)
    (tmp_path / "evaluate" / "acceptance.json").write_text(json.dumps(acceptance_report(chain)))
    (tmp_path / "draft" / "vllm").mkdir(parents=True, exist_ok=True)
    (tmp_path / "draft" / "vllm" / "config.json").write_text(json.dumps({"eagle_config": {
        "eaglet_aux_layer_ids": [1, 2, 3], "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}))
    return RunConfig.model_validate({"output_dir": str(tmp_path)})


def engine_agreement(drafts: float, accepted: list[float]) -> list[benchmark.VariantRun]:
    rows = [{"prompt": "mtbench:81#turn1", "output_tokens": 32, "drafts": drafts, "accepted_per_position": accepted}]
    return [benchmark.VariantRun(variant="eagle3", report={"agreement": rows})]


def test_an_engine_agreeing_at_every_position_passes_and_keeps_the_gap_as_information(tmp_path: Path) -> None:
    cfg = offline_run(tmp_path, rounds=220, accepted=(132, 66, 22))
    check = benchmark.check_agreement(cfg, "vllm", engine_agreement(200, [124, 58, 21]), steps=3)
    assert check["status"] == "ok" and check["min_p_value"] > cfg.registry.agreement_alpha
    assert [row["position"] for row in check["positions"]] == [1, 2, 3]
    first = check["positions"][0]
    assert first["engine"] == {"accepted": 124, "drafted": 200, "rate": 0.62}
    assert first["offline"] == {"accepted": 132, "drafted": 220, "rate": 0.6}
    assert check["relative_gap"] == pytest.approx(abs(2.015 - 2.0) / 2.0)
    (prompt,) = check["per_prompt"]
    assert prompt["prompt"] == "mtbench:81#turn1" and prompt["offline"]["rounds"] == 220 and prompt["engine"]["drafts"] == 200


def test_an_engine_that_accepts_nothing_fails_naming_the_position_and_pointing_at_layer_ids(tmp_path: Path) -> None:
    """The case the relative gap could not see: offline 3.5% at every position, the engine 0 of 180 (engine 1.00
    vs offline 1.11 is a gap of only 10%)."""
    cfg = offline_run(tmp_path, rounds=226, accepted=(8, 8, 8))
    check = benchmark.check_agreement(cfg, "vllm", engine_agreement(180, [0, 0, 0]), steps=3)
    assert check["status"] == "failed" and check["relative_gap"] < 0.15
    reason = check["reason"]
    assert "position 1: engine accepted 0/180 (0.0%), offline 8/226 (3.5%)" in reason
    assert "eagle_aux_hidden_state_layer_ids = [1, 2, 3] for trained layers [1, 2, 3]" in reason
    assert "docs/architecture.md §3" in reason and "chat_template" in reason and "vocab_mapping" in reason


def test_a_tiny_sample_is_inconclusive_and_says_its_numbers(tmp_path: Path) -> None:
    cfg = offline_run(tmp_path, rounds=12, accepted=(6, 3, 1))
    check = benchmark.check_agreement(cfg, "vllm", engine_agreement(11, [5, 3, 1]), steps=3)
    assert check["status"] == "inconclusive"
    assert check["reason"].startswith("too few drafts to tell: engine 11, offline 12 rounds (registry.agreement_min_drafts 50)")


def test_an_agreement_without_a_matching_offline_evaluation_is_not_a_pass(tmp_path: Path) -> None:
    other_steps = benchmark.check_agreement(offline_run(tmp_path, steps=5, accepted=(8, 8, 8, 8, 8)), "vllm",
                                            engine_agreement(180, [8, 8, 8]), steps=3)
    assert other_steps["status"] == "failed" and "chain of 3 steps" in other_steps["reason"]
    cfg = offline_run(tmp_path)
    assert benchmark.check_agreement(cfg, "vllm", [benchmark.VariantRun(variant="eagle3", report={})],
                                     steps=3)["status"] == "skipped"
    (tmp_path / "evaluate" / "acceptance.json").unlink()
    assert benchmark.check_agreement(cfg, "vllm", engine_agreement(180, [8, 8, 8]), steps=3)["status"] == "skipped"


def test_greedy_mismatches_name_the_prompt_and_the_first_difference() -> None:
    def variant(name: str, texts: list[str]) -> benchmark.VariantRun:
        results = [RequestResult(index=i, prompt_id=f"mtbench:{i}", text=text) for i, text in enumerate(texts)]
        return benchmark.VariantRun(variant=name, report={}, results={1: results})

    greedy = benchmark.compare_greedy(variant("baseline", ["same", "The cat sat."]),
                                      variant("eagle3", ["same", "The cat ran."]))
    assert greedy["status"] == "failed" and greedy["compared"] == 2
    [mismatch] = greedy["mismatches"]
    assert mismatch["prompt_id"] == "mtbench:1" and mismatch["first_difference"] == 8 and mismatch["concurrency"] == 1
    assert "mtbench:1" in benchmark.mismatch_message("vllm", greedy["mismatches"])


def test_missing_inputs_are_refused_before_any_engine_starts(tmp_path: Path) -> None:
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "benchmark": {"engines": ["vllm"]}})
    with pytest.raises(FileNotFoundError, match="run the target stage"):
        benchmark.run(cfg)
    skipped = benchmark.run(RunConfig.model_validate({"output_dir": str(tmp_path)}))
    assert skipped.report["skipped"].startswith("benchmark.engines is empty") and skipped.summary()["passed"] == 1.0
    assert skipped.reports() == [tmp_path / "benchmark" / "report.json", tmp_path / "benchmark" / "serving.png"]


def canned_inputs(directory: Path, kind: str, method: str = "eagle3") -> None:
    """The folders the stage checks before starting an engine, with an export's contract naming its method."""
    for name in ("target", f"draft/{kind}", "data"):
        (directory / name).mkdir(parents=True, exist_ok=True)
    (directory / "draft" / kind / "contract.json").write_text(json.dumps({"method": method}))


def test_an_engine_that_does_not_serve_the_method_is_refused_before_it_starts(tmp_path: Path) -> None:
    canned_inputs(tmp_path, "sglang", method="eagle3.1")
    (tmp_path / "data" / "eval.jsonl").write_text("")
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "tracking": {"enabled": False},
                                    "benchmark": {"engines": ["sglang"]}})
    with pytest.raises(ValueError, match=r"is an eagle3.1 drafter \(draft.method\), which sglang does not serve "
                                         r"\(it serves eagle3\): benchmark it on vllm"):
        benchmark.run(cfg)


def canned_variant(cfg: RunConfig, kind: str, variant: str, requests: list[ChatRequest], sampling: Sampling,
                   draft: Path | None, steps: int, round_number: int = 1, agreement=None) -> benchmark.VariantRun:
    """What measure_variant returns, without an engine serving float32 (the exact greedy check): the drafter changes
    the text of prompt s:2."""
    run = benchmark.VariantRun(variant=variant, round=round_number, report={
        "command": ["--dtype", "float32"], "log": "", "startup_s": 1.0, "peak_rss_mib": 100.0, "levels": []})
    for concurrency in cfg.benchmark.concurrency:
        results = []
        for chat in requests:
            text = "changed" if draft is not None and chat.prompt_id == "s:2#turn1" else f"answer to {chat.prompt_id}"
            results.append(RequestResult(index=chat.index, prompt_id=chat.prompt_id, text=text, output_tokens=4,
                                         content_chunks=4, ttft_s=0.1, latency_s=0.4, itl_s=[0.1] * 3))
        level = {"concurrency": concurrency, **summarize_level(results, wall_s=1.0 if draft else 2.0)}
        if draft is not None:
            window = {"drafts": 4.0, "draft_tokens": 12.0, "accepted": 6.0, "accepted_per_position": [3.0, 2.0, 1.0]}
            level["speculative"] = {"window": window, **spec_counters.acceptance(kind, window)}
        run.report["levels"].append(level)
        run.results[concurrency] = results
    return run


def test_a_failed_check_writes_the_report_then_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    canned_inputs(tmp_path, "vllm")
    records = [prompt_record(f"s:{i}", [{"role": "user", "content": f"question {i}"},
                                        {"role": "assistant", "content": f"answer {i}"}]) for i in (1, 2)]
    (tmp_path / "data" / "eval.jsonl").write_text("".join(record.model_dump_json() + "\n" for record in records))
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "tracking": {"enabled": False},
                                    "benchmark": {"engines": ["vllm"], "concurrency": [1, 2], "num_requests": 3}})
    monkeypatch.setattr(benchmark, "measure_variant", canned_variant)
    with pytest.raises(benchmark.BenchmarkFailed, match=r"prompts s:2#turn1 .*\nreport: .*report.json") as failure:
        benchmark.run(cfg)
    report = json.loads((tmp_path / "benchmark" / "report.json").read_text())
    assert not report["passed"] and len(report["failures"]) == 1
    greedy = report["engines"]["vllm"]["greedy"]
    assert greedy["compared"] == 6 and [m["request"] for m in greedy["mismatches"]] == [1, 1]
    assert report["engines"]["vllm"]["speedup"] == [
        {"concurrency": 1, "output_tokens_per_s": 2.0, "min": 2.0, "max": 2.0, "per_round": [2.0]},
        {"concurrency": 2, "output_tokens_per_s": 2.0, "min": 2.0, "max": 2.0, "per_round": [2.0]}]
    summary = failure.value.result.summary()
    assert summary["passed"] == 0.0 and summary["vllm_greedy_mismatches"] == 2.0
    assert summary["vllm_mean_accept_length"] == 2.5 and summary["vllm_acceptance_rate_pos2"] == 0.25
    assert (tmp_path / "benchmark" / "serving.png").is_file()
    assert len((tmp_path / "benchmark" / "requests.jsonl").read_text().splitlines()) == 2 * 2 * 3


def test_per_suite_traffic_is_served_suite_by_suite_and_its_speedup_reported_per_suite(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmark.per_suite: each suite's requests run at every level after the reference traffic, on the same
    engine; the speedup per suite pairs each round's drafted levels with that round's baseline levels."""
    for directory in ("target", "data"):
        (tmp_path / directory).mkdir(parents=True)
    records = [prompt_record(f"{source}:{i}", [{"role": "user", "content": f"{source} question {i}"},
                                               {"role": "assistant", "content": "a"}], source=source)
               for source in ("mtbench", "gsm8k") for i in (1, 2, 3)]
    (tmp_path / "data" / "eval.jsonl").write_text("".join(record.model_dump_json() + "\n" for record in records))
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "tracking": {"enabled": False},
                                    "evaluation": {"sources": ["mtbench"], "sets": [{"source": "gsm8k", "records": 2}]},
                                    "benchmark": {"engines": ["vllm"], "concurrency": [1, 2], "num_requests": 3,
                                                  "per_suite": True}})
    records_read = benchmark.select_records(tmp_path / "data" / "eval.jsonl", None, ["mtbench"])
    requests = benchmark.build_requests(records_read, 3) + benchmark.suite_requests(cfg, start=3)
    assert [(request.index, request.prompt_id, request.suite) for request in requests[3:]] == [
        (3, "gsm8k:1#turn1", "gsm8k"), (4, "gsm8k:2#turn1", "gsm8k"), (5, "gsm8k:1#turn1", "gsm8k")]

    served: list[tuple[Optional[str], int]] = []

    def scripted_level(engine, kind, traffic, sampling, concurrency, speculative):
        suite = traffic[0].suite
        served.append((suite, concurrency))
        results = [RequestResult(index=chat.index, prompt_id=chat.prompt_id, text="t", output_tokens=4,
                                 content_chunks=4, ttft_s=0.1, latency_s=0.4, itl_s=[0.1] * 3) for chat in traffic]
        wall = {(None, False): 2.0, (None, True): 1.0, ("gsm8k", False): 3.0, ("gsm8k", True): 2.0}[(suite, speculative)]
        level = {"concurrency": concurrency, **summarize_level(results, wall_s=wall)}
        if speculative:
            window = {"drafts": 4.0, "draft_tokens": 12.0, "accepted": 2.0 if suite else 6.0,
                      "accepted_per_position": [2.0, 0.0, 0.0] if suite else [3.0, 2.0, 1.0]}
            level["speculative"] = {"window": window, **spec_counters.acceptance(kind, window)}
        return level, results

    monkeypatch.setattr(benchmark, "measure_level", scripted_level)
    engine = SimpleNamespace(pid=os.getpid(), command=["serve"], log_path=tmp_path / "engine.log")
    baseline = benchmark.measure_levels(cfg, "vllm", engine, "baseline", requests, Sampling(0.0, 8), False, 1.0, 1)
    drafted = benchmark.measure_levels(cfg, "vllm", engine, "eagle3", requests, Sampling(0.0, 8), True, 1.0, 1)
    assert served[:4] == [(None, 1), (None, 2), ("gsm8k", 1), ("gsm8k", 2)], "reference traffic first, then per suite"
    assert [result.index for result in drafted.suite_results["gsm8k"][2]] == [3, 4, 5]
    assert [result.index for result in drafted.results[1]] == [0, 1, 2]

    per_suite = benchmark.suite_serving("vllm", [baseline], [drafted])
    assert per_suite["gsm8k"]["speedup"][0]["output_tokens_per_s"] == pytest.approx(1.5)
    assert per_suite["gsm8k"]["mean_accept_length"] == pytest.approx(1.5)
    rows = benchmark.request_rows("vllm", drafted)
    assert [row["suite"] for row in rows].count("gsm8k") == 6 and [row["suite"] for row in rows].count(None) == 6
    failed = replace(drafted.suite_results["gsm8k"][1][0], error="boom")
    drafted.suite_results["gsm8k"][1][0] = failed
    assert benchmark.failed_requests("vllm", drafted) == [
        "vllm eagle3 (round 1): 1 of 3 requests of suite gsm8k failed at concurrency 1, first: gsm8k:1#turn1: boom"]


def test_rounds_alternate_and_report_the_median_speedup_with_its_spread(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Three rounds whose machine gets noisier: each round's ratio pairs the engines that ran back to back."""
    canned_inputs(tmp_path, "vllm")
    record = prompt_record("s:1", [{"role": "user", "content": "question"}, {"role": "assistant", "content": "a"}])
    (tmp_path / "data" / "eval.jsonl").write_text(record.model_dump_json() + "\n")
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "tracking": {"enabled": False}, "benchmark": {
        "engines": ["vllm"], "concurrency": [1], "num_requests": 2, "rounds": 3}})
    order: list[tuple[str, int]] = []
    walls = {("baseline", 1): 2.0, ("eagle3", 1): 1.0, ("baseline", 2): 2.0, ("eagle3", 2): 1.6,
             ("baseline", 3): 4.0, ("eagle3", 3): 5.0}  # speedups 2.0, 1.25, 0.8

    def noisy_variant(cfg, kind, variant, requests, sampling, draft, steps, round_number=1, agreement=None):
        order.append((variant, round_number))
        run = canned_variant(cfg, kind, variant, requests, sampling, None, steps, round_number)
        for level in run.report["levels"]:
            level.update(summarize_level(run.results[level["concurrency"]], wall_s=walls[(variant, round_number)]))
            if draft is not None:
                window = {"drafts": 4.0, "draft_tokens": 12.0, "accepted": 3.0, "accepted_per_position": [2.0, 1.0, 0.0]}
                level["speculative"] = {"window": window, **spec_counters.acceptance(kind, window)}
        return run

    monkeypatch.setattr(benchmark, "measure_variant", noisy_variant)
    report = benchmark.run(cfg).report
    assert order == [("baseline", 1), ("eagle3", 1), ("baseline", 2), ("eagle3", 2), ("baseline", 3), ("eagle3", 3)]
    speedup = report["engines"]["vllm"]["speedup"][0]
    assert speedup["per_round"] == pytest.approx([2.0, 1.25, 0.8])
    assert speedup["output_tokens_per_s"] == pytest.approx(1.25)
    assert (speedup["min"], speedup["max"]) == pytest.approx((0.8, 2.0))
    eagle3 = report["engines"]["vllm"]["eagle3"]
    assert [entry["round"] for entry in eagle3["rounds"]] == [1, 2, 3]
    assert eagle3["levels"][0]["output_tokens_per_s"] == pytest.approx(8 / 1.6)  # the median round's level
    assert eagle3["speculative"]["window"]["drafts"] == 12.0  # acceptance counted over every round
    assert report["settings"]["rounds"] == 3 and report["engines"]["vllm"]["greedy"]["compared"] == 6


# --- the real vLLM CPU build ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafted_run(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path, vllm_python: Path) -> RunConfig:
    """target, data, capture and train on the tiny target; the drafter learns the target's own greedy text.

    The eval prompts are the training prompts: the engine then generates exactly what the drafter was
    trained on, so its drafts are accepted (the point here is serving, not generalisation).
    """
    from training_run import self_distilled_run, whole_word_target

    root = tmp_path_factory.mktemp("benchmark")
    model_dir = whole_word_target(tiny_target_dir, root / "word-target")
    cfg = RunConfig.model_validate({
        "output_dir": str(root / "run"), "model": {"source": "local", "path": str(model_dir)},
        "capture": {"aux_layer_ids": [1, 2, 3], "dtype": "float32", "draft_vocab_size": 128},
        "training": {"ttt_length": 3, "learning_rate": 3e-3, "tokens_per_step": 64, "epochs": 8, "warmup_ratio": 0.1,
                     "save_interval": 1000, "eval_interval": 1000},
        "evaluation": {"steps": 3, "max_new_tokens": 16, "sets": [{"source": "chats"}], "sets_on": "engine"},
        "benchmark": {"engines": ["vllm"], "concurrency": [1, 2], "num_requests": 4, "max_tokens": 16,
                      "per_suite": True},
        "registry": {"agreement_min_drafts": 20},  # 6 prompts of 16 tokens: ~30 drafts at this acceptance
        "runtime": {"engines": {"vllm": {"python": str(vllm_python), "port": free_port(),
                                         "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}}},
        "tracking": {"enabled": False},
    })
    return self_distilled_run(cfg)


def test_vllm_serves_the_drafter_faithfully_and_the_report_says_so(drafted_run: RunConfig) -> None:
    cfg = drafted_run
    from tasks import evaluate

    offline = evaluate.run(cfg).report["chain"]["mean_accept_length"]  # our reference decoder, same prompts
    with ConfigReads() as reads:  # a live engine: the reads tests/test_stage_reads.py cannot see without one
        result = benchmark.run(cfg)
    assert reads.undeclared(STAGE_READS["benchmark"].params, NOT_INPUTS) == [], "declare them in flows/stages.py"

    report = json.loads(result.report_path.read_text())
    assert report == json.loads(json.dumps(result.report)) and report["passed"] and report["failures"] == []
    assert report["settings"]["num_speculative_tokens"] == [3] and report["settings"]["distinct_prompts"] == 4
    vllm = report["engines"]["vllm"]
    for variant in benchmark.VARIANTS:
        run = vllm[variant]
        assert [level["concurrency"] for level in run["levels"]] == [1, 2]
        assert run["peak_rss_mib"] > 100 and run["startup_s"] > 0 and Path(run["log"]).is_file()
        for level in run["levels"]:
            assert level["completed"] == 4 and level["output_tokens"] > 4 and level["output_tokens_per_s"] > 0
            for name in ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms"):
                assert set(level[name]) == {"mean", "p50", "p90", "p99"} and level[name]["p50"] > 0
    assert "--speculative-config" in vllm["eagle3"]["command"]
    assert "--speculative-config" not in vllm["baseline"]["command"]

    speculative = vllm["eagle3"]["speculative"]
    assert speculative["window"]["drafts"] > 0, "the engine drafted"
    assert speculative["window"]["draft_tokens"] == 3 * speculative["window"]["drafts"]
    assert len(speculative["acceptance_rate_per_position"]) == 3
    assert speculative["mean_accept_length"] > 1.5, "drafts from the trained layers are accepted"
    assert {key: vllm["greedy"][key] for key in ("status", "compared", "mismatches")} == {
        "status": "ok", "compared": 8, "mismatches": []}
    assert vllm["greedy"]["rule"]["exact"] and vllm["greedy"]["rule"]["dtype"] == "float32"
    assert [row["concurrency"] for row in vllm["speedup"]] == [1, 2]
    check = vllm["acceptance_check"]
    assert check["status"] == "ok", "aux layers as trained: vLLM reads the export's ids as (layer + 1)"
    assert check["min_p_value"] >= cfg.registry.agreement_alpha and len(check["positions"]) == 3
    assert check["prompts"] == len(check["per_prompt"]) and check["offline_mean_accept_length"] == pytest.approx(offline)
    check_suites_on_the_engine(cfg, vllm)

    summary = result.summary()
    assert summary["vllm_mean_accept_length"] == speculative["mean_accept_length"]
    assert {"vllm_c1_speedup", "vllm_c2_eagle3_tpot_p50_ms", "vllm_acceptance_rate_pos0"} <= set(summary)
    assert summary["vllm_suites_mean_accept_length.source.chats"] == vllm["suites"]["mean_accept_length"]
    assert result.reports()[-1].name == "acceptance_by_suite_vllm.png", "logged to MLflow with the report"
    assert result.plot_path.is_file() and result.plot_path.stat().st_size > 0
    rows = [json.loads(line) for line in result.requests_path.read_text().splitlines()]
    assert len(rows) == 2 * 2 * (4 + 4) and all(row["error"] is None for row in rows), "reference and chats traffic"
    chats = vllm["sweep"][0]["suites"]["chats"]
    assert [row["concurrency"] for row in chats["speedup"]] == [1, 2] and chats["mean_accept_length"] > 1.5
    assert report["settings"]["suite_requests"] == {"chats": 4}
    print(f"\nagreement:\n{agreement_table(check)}")
    print(f"\nengine accept length {speculative['mean_accept_length']:.2f}, offline {offline:.2f}; "
          f"speedup {vllm['speedup']}")


def check_suites_on_the_engine(cfg: RunConfig, vllm: dict[str, Any]) -> None:
    """evaluation.sets_on: engine: every suite prompt replayed on the drafting engine, one at a time; a prompt the
    agreement run also replayed (same engine, same ids, greedy) reads the very same counters."""
    suites = vllm["suites"]
    assert suites["engine"] == "vllm" and suites["steps"] == 3 and suites["unit"] == "prompts"
    assert suites["prompts"] == 6 and [row["prompt"] for row in suites["per_prompt"]] == [
        f"chats:{index}#turn1" for index in range(6)]
    assert suites["mean_accept_length"] > 1.5 and suites["rounds"] == sum(row["rounds"] for row in suites["per_prompt"])
    interval = suites["mean_accept_length_interval"]
    assert interval["prompts"] == 6 and interval["low"] <= suites["mean_accept_length"] <= interval["high"]
    assert suites["buckets"]["source=chats"]["prompts"] == 6 and suites["tokens_per_second"] > 0
    replayed = {row["prompt"]: row["engine"] for row in vllm["acceptance_check"]["per_prompt"]}
    for row in suites["per_prompt"]:
        if row["prompt"] in replayed:
            engine = replayed[row["prompt"]]
            assert row["rounds"] == engine["drafts"] and row["accepted_per_position"] == engine["accepted_per_position"]
            assert row["generated_tokens"] == engine["output_tokens"] and row["source"] == "chats"
    offline = json.loads((cfg.output_path / "evaluate" / "acceptance.json").read_text())
    assert "suites" not in offline, "the suites are the engine's to measure"
    assert (cfg.output_path / "benchmark" / "acceptance_by_suite_vllm.png").stat().st_size > 1000


def agreement_table(check: dict[str, Any]) -> str:
    """The per-position table of an agreement check, as the closing notes quote it."""
    lines = ["position | engine accepted/drafted (rate) | offline accepted/drafted (rate) | p"]
    for row in check["positions"]:
        engine, offline = row["engine"], row["offline"]
        p_value = "n/a" if row["p_value"] is None else f"{row['p_value']:.3g}"
        lines.append(f"{row['position']} | {engine['accepted']:g}/{engine['drafted']:g} ({engine['rate'] or 0:.3f}) | "
                     f"{offline['accepted']:g}/{offline['drafted']:g} ({offline['rate'] or 0:.3f}) | {p_value}")
    return "\n".join(lines)


def replay_on_engine(cfg: RunConfig, draft: Path, variant: str, exact: bool = False) -> dict[str, Any]:
    """The offline evaluation's prompts on a vLLM engine serving `draft`, checked against the offline decoder
    (`exact`: with registry.agreement_exact, every prompt's rounds equal to the offline decoder's)."""
    if exact:
        cfg = cfg.model_copy(update={"registry": cfg.registry.model_copy(update={"agreement_exact": True})})
    from tasks.serving.agreement import run_agreement
    from tasks.serving.engine import serve
    from tasks.serving.serving_setting import ServingSetting

    steps = cfg.evaluation.steps
    launch = benchmark.engine_launch(cfg, "vllm", variant, draft, ServingSetting(steps))
    launch.port = free_port()
    prompts = benchmark.agreement_prompts(cfg)
    with serve(launch) as engine:
        rows = run_agreement(engine, "vllm", prompts, cfg.evaluation.max_new_tokens, cfg.evaluation.temperature)
    return benchmark.check_agreement(cfg, "vllm", [benchmark.VariantRun(variant=variant, report={"agreement": rows})],
                                     steps)


def engine_drafts(check: dict[str, Any]) -> list[tuple[Any, Any]]:
    """Each prompt's drafts and accepted tokens per position on the engine, from an agreement check."""
    return [(row["engine"]["drafts"], row["engine"]["accepted_per_position"]) for row in check["per_prompt"]]


def shuffled_vocab_export(export: Path, destination: Path) -> Path:
    """A copy of `export` whose d2t is shuffled: each draft id now names another target token."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(export, destination)
    tensors = load_file(str(destination / "model.safetensors"))
    draft_ids = torch.arange(tensors["d2t"].numel(), dtype=tensors["d2t"].dtype)
    target_ids = draft_ids + tensors["d2t"]
    order = torch.randperm(draft_ids.numel(), generator=torch.Generator().manual_seed(0))
    tensors["d2t"] = target_ids[order] - draft_ids
    save_file(tensors, str(destination / "model.safetensors"), metadata={"format": "pt"})
    return destination


def test_a_drafter_exported_with_a_shuffled_vocab_mapping_fails_the_agreement_check(drafted_run: RunConfig,
                                                                                    tmp_path: Path) -> None:
    """The same trained drafter, its vLLM export's d2t shuffled (each draft id now names another target token),
    replayed on the offline evaluation's prompts: the per-position test catches it. (Aux layer ids off by one are
    not caught on this 6-layer tiny target: neighbouring layers' states are too alike there, and the engine then
    accepted as much as offline; the capture stage's verification is what catches those.)"""
    from tasks import evaluate

    cfg = drafted_run
    if not (cfg.output_path / "evaluate" / "acceptance.json").is_file():
        evaluate.run(cfg)
    shuffled = shuffled_vocab_export(cfg.output_path / "draft" / "vllm", tmp_path / "draft-shuffled-vocab")
    check = replay_on_engine(cfg, shuffled, "eagle3-shuffled-vocab")
    print(f"\nshuffled vocab mapping:\n{agreement_table(check)}")
    assert check["status"] == "failed", agreement_table(check)
    assert check["reason"].startswith("vllm: the engine's acceptance differs from the offline decoder's on the same "
                                      "prompts: position 1: engine accepted")


@pytest.fixture(scope="module")
def eagle31_run(drafted_run: RunConfig, tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    """drafted_run's data and features trained again as EAGLE 3.1 (draft.method), exported and evaluated offline."""
    return retrained_run(drafted_run, tmp_path_factory.mktemp("eagle31") / "run", "eagle3.1")


@pytest.fixture(scope="module")
def peagle_run(drafted_run: RunConfig, tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    """The same, trained as P-EAGLE (a chain: the offline evaluation drafts it as vLLM does, in one pass)."""
    return retrained_run(drafted_run, tmp_path_factory.mktemp("peagle") / "run", "peagle")


def retrained_run(drafted_run: RunConfig, directory: Path, method: str) -> RunConfig:
    """drafted_run's inputs copied to `directory`, trained as `method`, exported and evaluated offline."""
    import shutil

    from contract.config import DraftConfig
    from tasks import evaluate, train

    produced = {"benchmark", "draft", "checkpoints", "train", "evaluate"}  # by the stages this run repeats

    def left_behind(folder: str, names: list[str]) -> list[str]:
        return [name for name in names if name in produced] if Path(folder) == drafted_run.output_path else []

    shutil.copytree(drafted_run.output_path, directory, ignore=left_behind)
    evaluation = drafted_run.evaluation.model_copy(update={"topk": 1})
    cfg = drafted_run.model_copy(update={"output_dir": str(directory), "draft": DraftConfig(method=method),
                                         "evaluation": evaluation})
    train.run(cfg)
    evaluate.run(cfg)
    return cfg


def test_vllm_serves_an_eagle31_drafter_as_trained_and_a_planted_defect_fails(eagle31_run: RunConfig,
                                                                             tmp_path: Path) -> None:
    """vLLM reads fc_norm and norm_output from config.json: the export agrees with the offline decoder per position;
    with its vocab mapping shuffled it fails; without `norm_output` (vLLM then carries the pre-norm output) the
    engine drafts otherwise, prompt by prompt, which shows the flag is read (on this tiny target the change is too
    small for the per-position test)."""
    import shutil

    cfg = eagle31_run
    export = cfg.output_path / "draft" / "vllm"
    config = json.loads((export / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert json.loads((export / "contract.json").read_text())["method"] == "eagle3.1"
    check = replay_on_engine(cfg, export, "eagle31")
    print(f"\nEAGLE 3.1 export:\n{agreement_table(check)}")
    assert check["status"] == "ok", agreement_table(check)
    assert check["engine_mean_accept_length"] > 1.5, "trained on this very text, its drafts are accepted"

    shuffled = shuffled_vocab_export(export, tmp_path / "eagle31-shuffled-vocab")
    failed = replay_on_engine(cfg, shuffled, "eagle31-shuffled-vocab")
    print(f"\nEAGLE 3.1 export, vocab mapping shuffled:\n{agreement_table(failed)}")
    assert failed["status"] == "failed", agreement_table(failed)

    pre_norm = tmp_path / "eagle31-without-norm-output"
    shutil.copytree(export, pre_norm)
    config.pop("norm_output")
    (pre_norm / "config.json").write_text(json.dumps(config))
    carried_otherwise = replay_on_engine(cfg, pre_norm, "eagle31-pre-norm")
    print(f"\nEAGLE 3.1 export without norm_output:\n{agreement_table(carried_otherwise)}")
    assert engine_drafts(check) != engine_drafts(carried_otherwise), "vLLM ignored norm_output"


def test_vllm_serves_a_peagle_drafter_in_one_pass_as_trained_and_planted_defects_fail(peagle_run: RunConfig,
                                                                                         tmp_path: Path) -> None:
    """P-EAGLE on vLLM's CPU build (parallel_drafting from the export): the engine agrees with the offline decoder's
    one-pass chain per position; a shuffled vocab mapping fails. With mask_hidden replaced by a large foreign vector
    the engine drafts otherwise, prompt by prompt (the state is read), though at ~46 drafts per position the test
    cannot call it significant. (Zeroing it is not enough here: a CI run drafted alike without it, the masked slots
    of this tiny drafter lean on attention over the context.)
    Another mask token in config.json is served and printed with the exact check: vLLM reads the id, but the masked
    slot's residual is fc(mask_hidden) and the token's embedding only enters its q/k/v, and on this tiny target vLLM
    drafted alike with it (docs/methods.md)."""
    import shutil

    cfg = peagle_run
    export = cfg.output_path / "draft" / "vllm"
    config = json.loads((export / "config.json").read_text())
    assert config["eagle_config"]["eaglet_parallel_drafting"] is True and isinstance(config["mask_token_id"], int)
    assert json.loads((export / "contract.json").read_text())["method"] == "peagle"
    check = replay_on_engine(cfg, export, "peagle")
    print(f"\nP-EAGLE export:\n{agreement_table(check)}")
    assert check["status"] == "ok", agreement_table(check)
    assert check["engine_mean_accept_length"] > 1.5, "trained on this very text, its drafts are accepted"
    assert check["positions"][1]["engine"]["accepted"] > 0, "the masked second slot is accepted too"

    shuffled = shuffled_vocab_export(export, tmp_path / "peagle-shuffled-vocab")
    failed = replay_on_engine(cfg, shuffled, "peagle-shuffled-vocab")
    print(f"\nP-EAGLE export, vocab mapping shuffled:\n{agreement_table(failed)}")
    assert failed["status"] == "failed", agreement_table(failed)

    wrong_mask = tmp_path / "peagle-wrong-mask-token"
    shutil.copytree(export, wrong_mask)
    config["mask_token_id"] = (config["mask_token_id"] + 1) % config["vocab_size"]
    (wrong_mask / "config.json").write_text(json.dumps(config))
    masked_otherwise = replay_on_engine(cfg, wrong_mask, "peagle-wrong-mask", exact=True)
    print(f"\nP-EAGLE export with another mask token, exact check (seen: vLLM drafts alike here):\n"
          f"{agreement_table(masked_otherwise)}\nexact: {masked_otherwise.get('exact')}")

    import torch
    from safetensors.torch import load_file, save_file

    lost_state = tmp_path / "peagle-without-its-mask-state"
    shutil.copytree(export, lost_state)
    tensors = load_file(str(lost_state / "model.safetensors"))
    learned = tensors["mask_hidden"]
    planted = torch.randn(learned.shape, generator=torch.Generator().manual_seed(0), dtype=learned.dtype)
    tensors["mask_hidden"] = planted * 100 * learned.abs().mean()  # dominates the masked slots' residual
    save_file(tensors, str(lost_state / "model.safetensors"), metadata={"format": "pt"})
    failed_state = replay_on_engine(cfg, lost_state, "peagle-foreign-mask-state")
    print(f"\nP-EAGLE export with a foreign, large mask state:\n{agreement_table(failed_state)}")
    assert engine_drafts(check) != engine_drafts(failed_state), "vLLM ignored mask_hidden"


@pytest.fixture(scope="module")
def dflash_run(drafted_run: RunConfig, tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    """The same, trained as DFlash: one Qwen3-style layer drafting [token, 3 masks] in one pass."""
    return retrained_run(drafted_run, tmp_path_factory.mktemp("dflash") / "run", "dflash")


def test_vllm_serves_a_dflash_drafter_in_one_block_as_trained_and_planted_defects_fail(dflash_run: RunConfig,
                                                                                        tmp_path: Path) -> None:
    """DFlash on vLLM's CPU build (method dflash, its DFlashDraftModel export, fp32): the engine drafts exactly what
    the offline block decoder drafts, prompt by prompt (registry.agreement_exact); a shuffled vocab mapping fails
    the per-position test; another mask token in the export changes what vLLM drafts, too little for the
    per-position test at ~50 drafts per position (26/53 vs 27/52 accepted at position 1), and the exact check
    fails it."""
    import shutil

    cfg = dflash_run
    export = cfg.output_path / "draft" / "vllm"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and "eagle_config" not in config
    assert config["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    assert json.loads((export / "contract.json").read_text())["method"] == "dflash"
    check = replay_on_engine(cfg, export, "dflash", exact=True)
    print(f"\nDFlash export:\n{agreement_table(check)}")
    assert check["status"] == "ok", agreement_table(check)
    assert check["engine_mean_accept_length"] > 1.5, "trained on this very text, its drafts are accepted"
    assert check["positions"][1]["engine"]["accepted"] > 0, "the second slot is accepted too"

    shuffled = shuffled_vocab_export(export, tmp_path / "dflash-shuffled-vocab")
    failed = replay_on_engine(cfg, shuffled, "dflash-shuffled-vocab")
    print(f"\nDFlash export, vocab mapping shuffled:\n{agreement_table(failed)}")
    assert failed["status"] == "failed", agreement_table(failed)

    wrong_mask = tmp_path / "dflash-wrong-mask-token"
    shutil.copytree(export, wrong_mask)
    config["dflash_config"]["mask_token_id"] = (config["dflash_config"]["mask_token_id"] + 1) % config["vocab_size"]
    (wrong_mask / "config.json").write_text(json.dumps(config))
    masked_otherwise = replay_on_engine(cfg, wrong_mask, "dflash-wrong-mask", exact=True)
    print(f"\nDFlash export with another mask token:\n{agreement_table(masked_otherwise)}")
    assert engine_drafts(check) != engine_drafts(masked_otherwise), "vLLM ignored dflash_config.mask_token_id"
    assert masked_otherwise["status"] == "failed" and masked_otherwise["exact"]["differing"] > 0, \
        masked_otherwise["reason"]
    assert "drafted otherwise than offline (registry.agreement_exact)" in masked_otherwise["reason"]


def test_vllm_sweep_measures_each_chain_length_and_recommends_the_fastest(drafted_run: RunConfig) -> None:
    from tasks import evaluate

    if not (drafted_run.output_path / "evaluate" / "acceptance.json").is_file():
        evaluate.run(drafted_run)
    settings = drafted_run.benchmark.model_copy(update={"num_speculative_tokens": [1, 3], "concurrency": [1],
                                                        "rounds": 2, "engine_starts": "once"})
    cfg = drafted_run.model_copy(update={"benchmark": settings})
    report = benchmark.run(cfg).report

    assert report["passed"] and report["settings"]["num_speculative_tokens"] == [1, 3]
    vllm = report["engines"]["vllm"]
    # engine_starts: once: three engines (own ports) started once each, both rounds measured on them
    ports = [command[command.index("--port") + 1] for command in (vllm["baseline"]["command"], vllm["eagle3"]["command"])]
    assert ports[0] != ports[1]
    for rounds in (vllm["baseline"]["rounds"], vllm["eagle3"]["rounds"]):
        assert [entry["round"] for entry in rounds] == [1, 2]
        assert rounds[0]["startup_s"] == rounds[1]["startup_s"], "one start per variant, not per round"
    assert all(len(row["speedup"][0]["per_round"]) == 2 for row in vllm["sweep"])
    assert not list((cfg.output_path / "benchmark" / "logs").glob("*-round2.log"))
    sweep = {row["num_speculative_tokens"]: row for row in vllm["sweep"]}
    assert set(sweep) == {1, 3} and all(row["mean_accept_length"] > 1.0 for row in sweep.values())
    assert all(row["predicted_speedup"] is not None for row in sweep.values())
    fastest = max(sweep, key=lambda k: sweep[k]["speedup"][0]["output_tokens_per_s"])
    assert vllm["num_speculative_tokens"] == fastest == vllm["eagle3"]["num_speculative_tokens"]
    window = vllm["eagle3"]["speculative"]["window"]
    assert window["draft_tokens"] == fastest * window["drafts"], "the recommended engine drafted its own length"
    assert vllm["acceptance_check"]["status"] == "ok" and vllm["acceptance_check"]["engine_steps"] == 3
    assert vllm["greedy"]["status"] == "ok" and vllm["greedy"]["compared"] == 16  # 4 requests, 2 settings, 2 rounds
    logs = cfg.output_path / "benchmark" / "logs"
    assert (logs / "vllm-eagle3-k1.log").is_file() and (logs / "vllm-eagle3-k3.log").is_file()
    print(f"\nsweep: { {k: (row['speedup'][0]['output_tokens_per_s'], row['predicted_speedup']) for k, row in sweep.items()} }")


def test_replays_run_on_an_engine_of_their_own_with_replay_engine_env(drafted_run: RunConfig) -> None:
    """benchmark.replay_engine_env: the speed rounds' engines keep vLLM's default (a core left to the client); the
    agreement run and the suites' replay go to one engine started afterwards with the given environment, and
    read what they read on the round's engine."""
    from tasks import evaluate

    if not (drafted_run.output_path / "evaluate" / "acceptance.json").is_file():
        evaluate.run(drafted_run)
    settings = drafted_run.benchmark.model_copy(update={
        "concurrency": [1], "rounds": 1, "engine_starts": "once", "per_suite": False,
        "replay_engine_env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}})
    cfg = drafted_run.model_copy(update={"benchmark": settings})
    report = benchmark.run(cfg).report

    assert report["passed"] and report["settings"]["replay_engine_env"] == ["VLLM_CPU_NUM_OF_RESERVED_CPU"]
    vllm = report["engines"]["vllm"]
    replay = vllm["eagle3"]["rounds"][0]["replay_engine"]
    assert replay["startup_s"] > 0 and "--speculative-config" in replay["command"]
    replay_log = Path(replay["log"]).read_text(encoding="utf-8")
    round_log = Path(vllm["eagle3"]["log"]).read_text(encoding="utf-8")
    assert Path(replay["log"]).name == "vllm-replay.log" and "reserve_cpu_num=0" in replay_log
    assert "reserve_cpu_num=0" not in round_log, "the rounds' engine runs as configured for serving"
    assert replay_log.count("POST /v1/completions") >= 6 and "POST /v1/completions" not in round_log
    assert vllm["acceptance_check"]["status"] == "ok"
    check_suites_on_the_engine(cfg, vllm)


SGLANG_PYTHON = REPO_ROOT / ".venv-sglang" / "bin" / "python"


def sglang_can_serve() -> bool:
    """SGLang serves on CUDA GPUs only (docs/architecture.md §6): a GPU and an SGLang environment with its server."""
    import subprocess

    import torch

    if not torch.cuda.is_available() or not SGLANG_PYTHON.is_file():
        return False
    probe = subprocess.run([str(SGLANG_PYTHON), "-c", "import sglang.launch_server"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not sglang_can_serve(), reason="SGLang serves only on a GPU host with .venv-sglang")
def test_sglang_serves_the_drafter_faithfully_on_a_gpu(drafted_run: RunConfig) -> None:
    from tasks import evaluate

    from contract.config import EngineConfig

    engines = {**drafted_run.runtime.engines, "sglang": EngineConfig(python=str(SGLANG_PYTHON), port=free_port())}
    cfg = drafted_run.model_copy(update={
        "benchmark": drafted_run.benchmark.model_copy(update={"engines": ["sglang"]}),
        "runtime": drafted_run.runtime.model_copy(update={"engines": engines}),
    })
    offline = evaluate.run(cfg).report["chain"]["mean_accept_length"]
    report = benchmark.run(cfg).report
    sglang = report["engines"]["sglang"]
    assert report["passed"] and "--speculative-algorithm" in sglang["eagle3"]["command"]
    assert sglang["greedy"]["status"] == "ok" and sglang["greedy"]["mismatches"] == []
    assert sglang["eagle3"]["speculative"]["mean_accept_length"] > 1.5
    assert sglang["acceptance_check"]["status"] == "ok" and sglang["acceptance_check"]["offline_mean_accept_length"] == offline


def sweep_run(tmp_path: Path, sweep: list[int], walls: dict[Any, float], kind: str = "vllm",
              trees: list[dict[str, int]] = (), tree_offline: dict[str, Any] | None = None,
              ) -> tuple[dict[str, Any], list[str]]:
    """The stage over canned engines whose wall time per request set depends on the variant (no engine)."""
    canned_inputs(tmp_path, kind)
    (tmp_path / "evaluate").mkdir(exist_ok=True)
    record = prompt_record("s:1", [{"role": "user", "content": "question"}, {"role": "assistant", "content": "a"}])
    (tmp_path / "data" / "eval.jsonl").write_text(record.model_dump_json() + "\n")
    chain = mode_acceptance(3, 10, [6, 5, 4], mean_accept_length=2.5, acceptance_by_depth=[0.6, 0.5, 0.4])
    tree = mode_acceptance(**tree_offline) if tree_offline is not None else None
    offline = acceptance_report(chain, tree)
    (tmp_path / "evaluate" / "acceptance.json").write_text(json.dumps(offline))
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "tracking": {"enabled": False}, "benchmark": {
        "engines": [kind], "concurrency": [1], "num_requests": 2, "rounds": 2, "num_speculative_tokens": sweep,
        "sglang_trees": list(trees)}})
    order: list[str] = []

    def canned(cfg, kind, variant, requests, sampling, draft, setting, round_number=1, agreement=None):
        order.append(f"{variant}/{setting.label}/r{round_number}")
        run = canned_variant(cfg, kind, variant, requests, sampling, None, setting.steps, round_number)
        if agreement is not None:  # the evaluation's prompt replayed: 4 rounds, 2 accepted at each position
            run.report["agreement"] = [{"prompt": prompt.key, "output_tokens": 10, "drafts": 4.0,
                                        "accepted_per_position": [2.0] * setting.steps} for prompt in agreement.prompts]
            if kind == "sglang":  # SGLang's /generate: the same 4 rounds as verify rounds and completion tokens
                run.report["agreement"] = [{"prompt": prompt.key, "verify_rounds": 4, "completion_tokens": 1 + 4 * 3}
                                           for prompt in agreement.prompts]
        level = run.report["levels"][0]
        level.update(summarize_level(run.results[1], wall_s=walls[variant]))
        if draft is not None:
            steps = setting.steps
            window = {"drafts": 4.0, "draft_tokens": 4.0 * steps, "accepted": 2.0 * steps,
                      "accepted_per_position": [2.0] * steps}
            if kind == "sglang":
                window = {"accept_length": 1.0 + 0.5 * steps, "accept_rate": 0.5}
            level["speculative"] = {"window": window, **spec_counters.acceptance(kind, window)}
        return run

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(benchmark, "measure_variant", canned)
    monkeypatch.setattr(benchmark, "agreement_prompts", lambda cfg: [SimpleNamespace(key="s:1#turn1")])
    try:
        report = benchmark.run(cfg).report
    finally:
        monkeypatch.undo()
    return report, order


def test_the_sweep_recommends_the_setting_with_the_best_median_speedup(tmp_path: Path) -> None:
    walls = {"baseline": 2.0, "eagle3-k1": 1.6, "eagle3-k2": 1.0, "eagle3-k3": 2.5}  # speedups 1.25, 2.0, 0.8
    report, order = sweep_run(tmp_path, [1, 2, 3], walls)
    assert order == ["baseline/k3/r1", "eagle3-k1/k1/r1", "eagle3-k2/k2/r1", "eagle3-k3/k3/r1",
                     "baseline/k3/r2", "eagle3-k1/k1/r2", "eagle3-k2/k2/r2", "eagle3-k3/k3/r2"]
    vllm = report["engines"]["vllm"]
    assert vllm["num_speculative_tokens"] == 2 and vllm["eagle3"]["num_speculative_tokens"] == 2
    assert vllm["speedup"][0]["output_tokens_per_s"] == pytest.approx(2.0)
    sweep = {row["num_speculative_tokens"]: row for row in vllm["sweep"]}
    assert [sweep[k]["speedup"][0]["output_tokens_per_s"] for k in (1, 2, 3)] == pytest.approx([1.25, 2.0, 0.8])
    # offline: verify 0.1 s per round, draft 0.02 s per token, target 10 tok/s -> (1 + sum a_d) / round_s / 10
    assert [sweep[k]["predicted_speedup"] for k in (1, 2, 3)] == pytest.approx(
        [1.6 / 0.12 / 10, 2.1 / 0.14 / 10, 2.5 / 0.16 / 10])
    # the engine's agreement run is at the offline chain length (k = evaluation.steps = 3): 1 + 6/4 = 2.5, and only
    # the k3 engine of round 1 replays the evaluation's prompts
    check = vllm["acceptance_check"]
    assert check["engine_mean_accept_length"] == pytest.approx(2.5) == check["offline_mean_accept_length"]
    assert check["status"] == "inconclusive" and check["engine_steps"] == 3, "4 and 10 drafts cannot tell"
    assert report["settings"]["num_speculative_tokens"] == [1, 2, 3] and report["settings"]["offline_steps"] == 3
    summary = benchmark.BenchmarkResult(tmp_path, tmp_path, None, report).summary()
    assert summary["vllm_recommended_num_speculative_tokens"] == 2.0
    assert summary["vllm_k1_c1_speedup"] == pytest.approx(1.25)
    assert vllm["serving_setting"] == {"steps": 2, "topk": 1, "num_draft_tokens": 3, "label": "k2", "flags": {
        "speculative_config": {"method": "eagle3", "num_speculative_tokens": 2}}}


def test_sglang_sweeps_trees_beside_the_chains_and_can_recommend_a_tree(tmp_path: Path) -> None:
    # baseline 2.0 s; chain k3 1.6 s (1.25x); tree s3-t4-n8 1.0 s (2.0x); the full tree s2-t2-n5 2.5 s (0.8x)
    walls = {"baseline": 2.0, "eagle3-k3": 1.6, "eagle3-s3-t4-n8": 1.0, "eagle3-s2-t2-n5": 2.5}
    tree_offline = {"steps": 3, "topk": 4, "num_draft_tokens": 8, "mean_accept_length": 3.0, "rounds": 10,
                    "verify_seconds": 1.5, "draft_seconds": 0.5}
    report, order = sweep_run(tmp_path, [3], walls, kind="sglang", tree_offline=tree_offline,
                              trees=[{"steps": 3, "topk": 4, "num_draft_tokens": 8}, {"steps": 2, "topk": 2}])
    assert order[:4] == ["baseline/k3/r1", "eagle3-k3/k3/r1", "eagle3-s3-t4-n8/s3-t4-n8/r1", "eagle3-s2-t2-n5/s2-t2-n5/r1"]
    sglang = report["engines"]["sglang"]
    assert sglang["num_speculative_tokens"] is None, "a tree is not a vLLM chain length"
    assert sglang["serving_setting"] == {"steps": 3, "topk": 4, "num_draft_tokens": 8, "label": "s3-t4-n8", "flags": {
        "--speculative-num-steps": 3, "--speculative-eagle-topk": 4, "--speculative-num-draft-tokens": 8}}
    rows = {row["label"]: row for row in sglang["sweep"]}
    assert [rows[label]["speedup"][0]["output_tokens_per_s"] for label in ("k3", "s3-t4-n8", "s2-t2-n5")] == \
        pytest.approx([1.25, 2.0, 0.8])
    # the tree the evaluate stage decoded: 3.0 tokens per 0.2 s round at a 10 tok/s target; no offline run of the other
    assert rows["s3-t4-n8"]["predicted_speedup"] == pytest.approx(3.0 / 0.2 / 10)
    assert rows["s2-t2-n5"]["predicted_speedup"] is None
    check = sglang["acceptance_check"]
    assert check["engine_steps"] == 3, "checked at the offline chain, not at the winning tree"
    assert check["check"] == "totals" and check["status"] == "inconclusive", "4 verify rounds on SGLang cannot tell"
    summary = benchmark.BenchmarkResult(tmp_path, tmp_path, None, report).summary()
    assert summary["sglang_recommended_topk"] == 4.0 and summary["sglang_s3-t4-n8_c1_speedup"] == pytest.approx(2.0)
    assert report["settings"]["sglang_trees"][1] == {"steps": 2, "topk": 2, "num_draft_tokens": None}


def test_vllm_ignores_sglang_trees(tmp_path: Path) -> None:
    report, order = sweep_run(tmp_path, [1], {"baseline": 2.0, "eagle3": 1.0}, trees=[{"steps": 3, "topk": 4}])
    assert [row["label"] for row in report["engines"]["vllm"]["sweep"]] == ["k1"]
    assert order == ["baseline/k3/r1", "eagle3/k1/r1", "baseline/k3/r2", "eagle3/k1/r2"]


def test_a_tree_larger_than_its_steps_and_topk_is_refused() -> None:
    with pytest.raises(ValueError, match=r"20 cannot be verified by a tree of steps 3 x topk 2: it verifies 2\.\.11 tokens"):
        RunConfig.model_validate({"benchmark": {"sglang_trees": [{"steps": 3, "topk": 2, "num_draft_tokens": 20}]}})
    beyond_the_frontier = RunConfig.model_validate(
        {"benchmark": {"sglang_trees": [{"steps": 3, "topk": 2, "num_draft_tokens": 11}]}})
    assert beyond_the_frontier.benchmark.sglang_trees[0].num_draft_tokens == 11, "leaves of unexpanded nodes verify too"


def test_a_sweep_without_the_offline_chain_length_skips_the_acceptance_check(tmp_path: Path) -> None:
    report, _ = sweep_run(tmp_path, [1], {"baseline": 2.0, "eagle3": 1.0})
    check = report["engines"]["vllm"]["acceptance_check"]
    assert check == {"status": "skipped", "reason": "benchmark.num_speculative_tokens [1] does not include "
                     "evaluation.steps 3, the chain the offline evaluation measured"}
    assert report["engines"]["vllm"]["num_speculative_tokens"] == 1 and report["passed"]


@pytest.mark.parametrize("sweep", [[0, 1], [2, 2]])
def test_bad_sweep_settings_are_refused_naming_the_field(sweep: list[int]) -> None:
    with pytest.raises(ValueError, match=r"benchmark.num_speculative_tokens must be distinct and >= 1"):
        RunConfig.model_validate({"benchmark": {"num_speculative_tokens": sweep}})
