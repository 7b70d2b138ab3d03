"""Several replicas of one model behind `regeneration.base_url` (a list): spread the requests, fail over.

Each endpoint takes at most `regeneration.concurrency` requests at once; a request goes to the live endpoint with
the fewest in flight. An endpoint whose request failed transiently (connection refused, timeout, 5xx, 429) is set
aside for an exponentially growing pause and the retry goes to another endpoint at once; it is tried again after
the pause, and its first answer brings it back. The caller still counts one reply per request, so every record id
ends exactly once, whichever endpoint answered.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

from tasks.data.server_access import ServerAccess

#: How often a request waiting for a free endpoint looks again (only when every live endpoint is full).
WAIT_POLL_S = 0.01


@dataclass
class Endpoint:
    """One replica and what the pool knows of it."""

    access: ServerAccess
    in_flight: int = 0
    down_until: float = 0.0
    failures_in_a_row: int = 0
    answered: int = 0
    failed: int = 0

    def live(self, now: float) -> bool:
        return self.down_until <= now


class EndpointPool:
    """Least-loaded choice among live endpoints, with per-endpoint concurrency and failover pauses."""

    def __init__(self, accesses: list[ServerAccess], per_endpoint: int,
                 pause_seconds: Callable[[int], float]) -> None:
        if not accesses:
            raise ValueError("no endpoint to send requests to")
        self.endpoints = [Endpoint(access) for access in accesses]
        self.per_endpoint = per_endpoint
        self.pause_seconds = pause_seconds
        self.failovers = 0

    @property
    def capacity(self) -> int:
        """Requests in flight over all endpoints."""
        return self.per_endpoint * len(self.endpoints)

    def choose(self, candidates: list[Endpoint], now: float) -> Endpoint | None:
        """The live candidate with a free slot and the fewest in flight (then the fewest answered), or None."""
        free = [e for e in candidates if e.live(now) and e.in_flight < self.per_endpoint]
        if not free:
            return None
        return min(free, key=lambda e: (e.in_flight, e.answered))

    async def acquire(self, avoid: frozenset[int] = frozenset()) -> Endpoint:
        """Wait for an endpoint with a free slot, preferring those not in `avoid` (positions of the endpoints that
        already failed this request); when every candidate is paused, the one whose pause ends first is tried."""
        candidates = [e for index, e in enumerate(self.endpoints) if index not in avoid] or self.endpoints
        while True:
            now = time.monotonic()
            endpoint = self.choose(candidates, now)
            if endpoint is not None:
                endpoint.in_flight += 1
                return endpoint
            if any(e.live(now) for e in candidates):
                await asyncio.sleep(WAIT_POLL_S)
                continue
            soonest = min(candidates, key=lambda e: e.down_until)
            await asyncio.sleep(max(0.0, soonest.down_until - now))
            soonest.down_until = min(soonest.down_until, time.monotonic())

    def position(self, endpoint: Endpoint) -> int:
        return self.endpoints.index(endpoint)

    def answered(self, endpoint: Endpoint) -> None:
        endpoint.in_flight -= 1
        endpoint.answered += 1
        endpoint.failures_in_a_row = 0

    def failed(self, endpoint: Endpoint) -> None:
        """A request failed transiently: pause its endpoint so that the retry goes elsewhere."""
        endpoint.in_flight -= 1
        self.pause(endpoint)

    def pause(self, endpoint: Endpoint) -> None:
        """Set the endpoint aside for a pause that grows with its failures in a row."""
        endpoint.failed += 1
        endpoint.failures_in_a_row += 1
        endpoint.down_until = time.monotonic() + self.pause_seconds(endpoint.failures_in_a_row)
        if len(self.endpoints) > 1:
            self.failovers += 1

    def metrics(self) -> dict[str, float]:
        """Replies and transient failures per endpoint (by position in regeneration.base_url), and failovers."""
        numbers: dict[str, float] = {"endpoint_failovers": float(self.failovers)}
        for index, endpoint in enumerate(self.endpoints):
            numbers[f"endpoint_{index}_replies"] = float(endpoint.answered)
            numbers[f"endpoint_{index}_failures"] = float(endpoint.failed)
        return numbers
