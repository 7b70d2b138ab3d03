"""The OpenAI-compatible backend: any `/v1/chat/completions` server (SGLang on GPU, vLLM's CPU build here).

Requests run concurrently up to a limit. `generate` answers a list at once (a round of turns); the
regenerate stage instead streams records through `generate_one`, so each record's next turn is sent the
moment its previous one returns and the engine's batch never drains between rounds. Transient failures (429, 5xx, connection errors, timeouts) are
retried with exponential backoff; a 4xx bad request is not retried, since sending it again cannot help: its reply
is marked `refused`, and the regenerate stage stops when the server refuses every request (tasks/regenerate.py).
Every request carries the configured credentials and headers (tasks/data/server_access.py). `regeneration.base_url`
may list several replicas of the model: requests are spread over them and fail over (tasks/data/endpoints.py).
Before any request the endpoints are asked what they serve, and a model other than the run's target is refused
(tasks/data/served_model.py).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, Optional

import httpx

from contract.config import RegenerationConfig
from tasks.data.endpoints import EndpointPool
from tasks.data.generation import GenerationReply, GenerationRequest
from tasks.data.server_access import server_access
from tasks.data.served_model import check_served_name, identity_of, read_model_card

RETRYABLE_STATUS = {408, 409, 425, 429}
TRANSIENT_ERRORS = (httpx.TransportError, httpx.TimeoutException)


class OpenAIGenerator:
    backend = "openai"
    streams_records = True

    def __init__(self, base_urls: str | list[str], settings: RegenerationConfig, model: Optional[str] = None,
                 template_kwargs: Optional[dict[str, Any]] = None, expected_model: Optional[tuple[str, str]] = None,
                 ) -> None:
        """`expected_model`: (name, config field naming it) the endpoints must serve (tasks/data/served_model.py);
        None accepts what they serve. `model` skips asking them (no identity is known then)."""
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        self.settings = settings
        self.template_kwargs = dict(template_kwargs or {})
        self.rng = random.Random(settings.seed)
        self.pool = EndpointPool([server_access(url, settings) for url in urls], settings.concurrency,
                                 self.backoff_seconds)
        self.base_url = ", ".join(endpoint.access.base_url for endpoint in self.pool.endpoints)  # for messages
        self.identity: Optional[dict[str, Any]] = None  # what the first answering endpoint serves
        self.model = model or self.served_model(expected_model)

    def served_model(self, expected: Optional[tuple[str, str]] = None) -> str:
        """The model the endpoints serve (engines serve one; replicas must agree), refused unless it is `expected`.
        An endpoint that does not answer is paused like one that failed a request; the stage starts as long as one
        answers."""
        served: dict[str, str] = {}
        first_problem: Optional[Exception] = None
        for endpoint in self.pool.endpoints:
            url = endpoint.access.base_url
            try:
                card = read_model_card(endpoint.access, self.settings.request_timeout_s)
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as problem:
                first_problem = first_problem or problem
                self.pool.pause(endpoint)
                continue
            served[url] = card["id"]
            self.identity = self.identity or identity_of(card)
        if not served and first_problem is not None:
            raise first_problem
        for url in {endpoint.access.base_url for endpoint in self.pool.endpoints} - set(served):
            print(f"[regenerate] {url}/models did not answer; its requests go to the other endpoints", flush=True)
        models = sorted(set(served.values()))
        if len(models) > 1:
            raise ValueError(f"regeneration.base_url: the endpoints serve different models ({served}); replicas of "
                             "one model are expected")
        if expected is not None:
            check_served_name(models[0], *expected, self.base_url)
        return models[0]

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationReply]:
        return asyncio.run(self.generate_all(requests))

    async def generate_all(self, requests: list[GenerationRequest]) -> list[GenerationReply]:
        limit = asyncio.Semaphore(self.pool.capacity)
        async with self.client() as client:

            async def one(request: GenerationRequest) -> GenerationReply:
                async with limit:
                    return await self.generate_one(client, request)

            return list(await asyncio.gather(*(one(request) for request in requests)))

    def client(self) -> httpx.AsyncClient:
        """One connection pool for a stage's requests (`generate_one` takes it); each request carries its
        endpoint's headers."""
        limits = httpx.Limits(max_connections=self.pool.capacity + 4)
        return httpx.AsyncClient(timeout=httpx.Timeout(self.settings.request_timeout_s), limits=limits)

    def payload(self, request: GenerationRequest) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": request.messages,
            "max_tokens": self.settings.max_new_tokens,
            "temperature": self.settings.temperature,
            "top_p": self.settings.top_p,
            "seed": request.seed,
            **({"chat_template_kwargs": self.template_kwargs} if self.template_kwargs else {}),
        }

    async def generate_one(self, client: httpx.AsyncClient, request: GenerationRequest) -> GenerationReply:
        """POST with retries, each to the least-loaded live endpoint (a failed one is paused, so a retry fails over);
        every outcome becomes a reply."""
        last_problem = ""
        failed_here: set[int] = set()  # endpoints that failed this request: its retries go elsewhere first
        for _ in range(self.settings.max_retries + 1):
            endpoint = await self.pool.acquire(frozenset(failed_here))
            url = f"{endpoint.access.base_url}/chat/completions"
            try:
                response = await client.post(url, json=self.payload(request), headers=endpoint.access.headers)
            except TRANSIENT_ERRORS as error:
                self.pool.failed(endpoint)
                failed_here.add(self.pool.position(endpoint))
                last_problem = f"{url}: {type(error).__name__}: {error}"
                continue
            if response.status_code == 200:
                self.pool.answered(endpoint)
                return self.reply_from(request, response.json())
            last_problem = f"HTTP {response.status_code}: {response.text[:300]}"
            if response.status_code < 500 and response.status_code not in RETRYABLE_STATUS:
                self.pool.answered(endpoint)  # the server is up; sending it again cannot help
                return GenerationReply(request.record_id, request.turn, error=f"not retried, {last_problem}",
                                       refused=True)
            self.pool.failed(endpoint)
            failed_here.add(self.pool.position(endpoint))
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
