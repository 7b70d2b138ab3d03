"""A streaming client for OpenAI-compatible chat servers, and the latency statistics of a serving benchmark.

Each request is sent with `stream: true` and `stream_options.include_usage`, so the client sees every
content chunk as the server emits it and the exact output token count at the end:

    TTFT     time from sending the request to the first non-empty content chunk
    ITL      time between consecutive content chunks (with speculative decoding one chunk can carry
             several tokens, so ITL is per chunk, as in vLLM's and SGLang's own serving benchmarks)
    TPOT     (latency - TTFT) / (output tokens - 1): the mean time per token after the first
    latency  time from sending the request to the end of the stream

`run_level` sends a list of requests with at most `concurrency` in flight and summarises them with
`summarize_level` (throughput over the level's wall time; mean and P50/P90/P99 of each latency).

    results, wall_s = asyncio.run(run_level(base_url, "target", requests, Sampling(0.0, 128), concurrency=4))
    summarize_level(results, wall_s)["output_tokens_per_s"]
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

#: Percentiles reported for every latency.
PERCENTILES = (50, 90, 99)
#: Generous: at concurrency c on 2 CPU cores one request may wait for c - 1 others.
REQUEST_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class ChatRequest:
    """One benchmark request: the messages to send and the prompt it came from."""

    index: int
    prompt_id: str
    messages: list[dict[str, str]]
    suite: Optional[str] = None  # None: the reference prompts' traffic; else the eval set it serves (per_suite)


@dataclass(frozen=True)
class Sampling:
    """Sampling settings shared by every request of a benchmark, and the chat-template variables the engine renders
    the messages with (`model.chat_template_kwargs`: what training rendered)."""

    temperature: float
    max_tokens: int
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestResult:
    """What one streamed request measured (times in seconds from sending it)."""

    index: int
    prompt_id: str
    text: str = ""
    output_tokens: int = 0
    content_chunks: int = 0
    ttft_s: Optional[float] = None
    latency_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    usage_reported: bool = False
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> Optional[float]:
        """Mean time per output token after the first; None when there is no second token."""
        return time_per_output_token(self.latency_s, self.ttft_s, self.output_tokens)


def time_per_output_token(latency_s: Optional[float], ttft_s: Optional[float], output_tokens: int) -> Optional[float]:
    """(latency - TTFT) / (output tokens - 1): the first token's time is TTFT, not decoding."""
    if latency_s is None or ttft_s is None or output_tokens < 2:
        return None
    return (latency_s - ttft_s) / (output_tokens - 1)


def chat_payload(model: str, request: ChatRequest, sampling: Sampling) -> dict[str, Any]:
    """The request body; only standard OpenAI fields (no `ignore_eos`), so any compatible server takes it."""
    return {
        "model": model,
        "messages": request.messages,
        "temperature": sampling.temperature,
        "max_tokens": sampling.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"chat_template_kwargs": sampling.chat_template_kwargs} if sampling.chat_template_kwargs else {}),
    }


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text a streamed chunk carries (content, or reasoning_content of reasoning parsers)."""
    pieces = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        pieces.append(delta.get("content") or "")
        pieces.append(delta.get("reasoning_content") or "")
    return "".join(pieces)


def chunk_finish_reason(chunk: dict[str, Any]) -> Optional[str]:
    for choice in chunk.get("choices") or []:
        if choice.get("finish_reason"):
            return choice["finish_reason"]
    return None


def server_sent_data(line: str) -> Optional[str]:
    """The payload of an SSE `data:` line; None for comments, blank lines and other fields."""
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


class StreamTimer:
    """Turns the chunks of one stream into TTFT, inter-chunk latencies and the end-to-end latency."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.started = time.perf_counter()
        self.last_content: Optional[float] = None
        self.pieces: list[str] = []

    def on_chunk(self, chunk: dict[str, Any]) -> None:
        now = time.perf_counter()
        text = chunk_text(chunk)
        if text:
            if self.last_content is None:
                self.result.ttft_s = now - self.started
            else:
                self.result.itl_s.append(now - self.last_content)
            self.last_content = now
            self.result.content_chunks += 1
            self.pieces.append(text)
        self.result.finish_reason = chunk_finish_reason(chunk) or self.result.finish_reason
        usage = chunk.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.result.output_tokens = int(usage["completion_tokens"])
            self.result.usage_reported = True

    def finish(self) -> None:
        self.result.latency_s = time.perf_counter() - self.started
        self.result.text = "".join(self.pieces)
        if not self.result.usage_reported:
            # A server without include_usage: one chunk per token is the best estimate there is.
            self.result.output_tokens = self.result.content_chunks


def stream_error(error: Any) -> str:
    """The message of an OpenAI-style error object (vLLM and SGLang send `{"error": {"message": ...}}`)."""
    if isinstance(error, dict):
        return str(error.get("message") or error)[:300]
    return str(error)[:300]


async def stream_chat(client: httpx.AsyncClient, base_url: str, model: str, request: ChatRequest,
                      sampling: Sampling) -> RequestResult:
    """Send one streaming chat completion and time it; a failure becomes `error`, never an exception."""
    result = RequestResult(index=request.index, prompt_id=request.prompt_id)
    timer = StreamTimer(result)
    url = f"{base_url.rstrip('/')}/chat/completions"
    try:
        async with client.stream("POST", url, json=chat_payload(model, request, sampling)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                data = server_sent_data(line)
                if data is None or data == "":
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # a server that failed after its 200 reports it inside the stream
                    result.error = f"error in the stream: {stream_error(chunk['error'])}"
                    return result
                timer.on_chunk(chunk)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    timer.finish()
    return result


async def run_level(base_url: str, model: str, requests: list[ChatRequest], sampling: Sampling,
                    concurrency: int) -> tuple[list[RequestResult], float]:
    """Send every request with at most `concurrency` in flight; returns the results (in request order)
    and the level's wall time from the first send to the last completion."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    limit = asyncio.Semaphore(concurrency)
    connections = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # trust_env=False: the engine is on 127.0.0.1 and must not be reached through a proxy.
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=connections,
                                 trust_env=False) as client:

        async def one(request: ChatRequest) -> RequestResult:
            async with limit:
                return await stream_chat(client, base_url, model, request, sampling)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(request) for request in requests))
        wall_s = time.perf_counter() - started
    return list(results), wall_s


# --- statistics -----------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must lie in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(values_s: list[float]) -> dict[str, Optional[float]]:
    """Mean and percentiles of latencies given in seconds, in milliseconds (None when there are none)."""
    keys = ["mean"] + [f"p{q}" for q in PERCENTILES]
    if not values_s:
        return {key: None for key in keys}
    stats = {"mean": 1000.0 * sum(values_s) / len(values_s)}
    for q in PERCENTILES:
        stats[f"p{q}"] = 1000.0 * percentile(values_s, q)
    return stats


def summarize_level(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """Throughput and latency distributions of one concurrency level (failed requests are only counted)."""
    done = [result for result in results if result.ok]
    output_tokens = sum(result.output_tokens for result in done)
    chunks = sum(result.content_chunks for result in done)
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": wall_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(done) / wall_s if wall_s > 0 else 0.0,
        "tokens_per_chunk": output_tokens / chunks if chunks else None,
        "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s]),
        "latency_ms": distribution_ms([r.latency_s for r in done if r.latency_s is not None]),
    }
