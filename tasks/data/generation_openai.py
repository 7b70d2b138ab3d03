"""The OpenAI-compatible backend: any `/v1/chat/completions` server (SGLang on GPU, vLLM's CPU build here).

Requests run concurrently up to a limit. `generate` answers a list at once (a round of turns); the
regenerate stage instead streams records through `generate_one`, so each record's next turn is sent the
moment its previous one returns and the engine's batch never drains between rounds. Transient failures (429, 5xx, connection errors, timeouts) are
retried with exponential backoff; a 4xx bad request is not retried, since sending it again cannot help: its reply
is marked `refused`, and the regenerate stage stops when the server refuses every request (tasks/regenerate.py).
Every request carries the configured credentials and headers (tasks/data/server_access.py).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, Optional

import httpx

from contract.config import RegenerationConfig
from tasks.data.generation import GenerationReply, GenerationRequest
from tasks.data.server_access import server_access

RETRYABLE_STATUS = {408, 409, 425, 429}
TRANSIENT_ERRORS = (httpx.TransportError, httpx.TimeoutException)


class OpenAIGenerator:
    backend = "openai"
    streams_records = True

    def __init__(self, base_url: str, settings: RegenerationConfig, model: Optional[str] = None) -> None:
        self.access = server_access(base_url, settings)
        self.base_url = self.access.base_url
        self.settings = settings
        self.model = model or self.first_served_model()
        self.rng = random.Random(settings.seed)

    def first_served_model(self) -> str:
        """The server's first model id (engines serve one model)."""
        response = httpx.get(f"{self.base_url}/models", headers=self.access.headers,
                             timeout=self.settings.request_timeout_s)
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationReply]:
        return asyncio.run(self.generate_all(requests))

    async def generate_all(self, requests: list[GenerationRequest]) -> list[GenerationReply]:
        limit = asyncio.Semaphore(self.settings.concurrency)
        async with self.client() as client:

            async def one(request: GenerationRequest) -> GenerationReply:
                async with limit:
                    return await self.generate_one(client, request)

            return list(await asyncio.gather(*(one(request) for request in requests)))

    def client(self) -> httpx.AsyncClient:
        """One connection pool for a stage's requests (`generate_one` takes it)."""
        limits = httpx.Limits(max_connections=self.settings.concurrency + 4)
        return httpx.AsyncClient(headers=self.access.headers, timeout=httpx.Timeout(self.settings.request_timeout_s),
                                 limits=limits)

    def payload(self, request: GenerationRequest) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": request.messages,
            "max_tokens": self.settings.max_new_tokens,
            "temperature": self.settings.temperature,
            "top_p": self.settings.top_p,
            "seed": request.seed,
        }

    async def generate_one(self, client: httpx.AsyncClient, request: GenerationRequest) -> GenerationReply:
        """POST with retries; every outcome becomes a reply."""
        last_problem = ""
        for attempt in range(self.settings.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_seconds(attempt))
            try:
                response = await client.post(f"{self.base_url}/chat/completions", json=self.payload(request))
            except TRANSIENT_ERRORS as error:
                last_problem = f"{type(error).__name__}: {error}"
                continue
            if response.status_code == 200:
                return self.reply_from(request, response.json())
            last_problem = f"HTTP {response.status_code}: {response.text[:300]}"
            if response.status_code < 500 and response.status_code not in RETRYABLE_STATUS:
                return GenerationReply(request.record_id, request.turn, error=f"not retried, {last_problem}",
                                       refused=True)
        attempts = self.settings.max_retries + 1
        return GenerationReply(request.record_id, request.turn, error=f"gave up after {attempts} attempts, last: {last_problem}")

    def backoff_seconds(self, attempt: int) -> float:
        """Exponential backoff with a little jitter, capped."""
        base = self.settings.backoff_initial_s * 2 ** (attempt - 1)
        return min(self.settings.backoff_max_s, base) * (1 + 0.1 * self.rng.random())

    @staticmethod
    def reply_from(request: GenerationRequest, body: dict[str, Any]) -> GenerationReply:
        try:
            choice = body["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            return GenerationReply(request.record_id, request.turn, error=f"malformed response: {str(body)[:200]}")
        usage = body.get("usage") or {}
        return GenerationReply(
            request.record_id,
            request.turn,
            text=message.get("content") or "",
            reasoning=message.get("reasoning_content") or message.get("reasoning"),
            finish_reason=choice.get("finish_reason") or "",
            completion_tokens=int(usage.get("completion_tokens") or 0),
        )

    def close(self) -> None:
        return None
