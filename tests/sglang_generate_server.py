"""An in-process server answering SGLang's native `POST /generate` the way SGLang does with EAGLE drafting on.

Each prompt (its `input_ids`, as a tuple) maps to a scripted decode: the verify rounds it takes and the tokens it
emits. The reply carries SGLang's `meta_info` (`completion_tokens`, the prefill's token included, and
`spec_verify_ct`, the verify rounds), cut at the request's `max_new_tokens` the way SGLang stops appending a round's
tokens once the budget is reached. Every request body is kept, to check what the replay sent, and the most requests
in flight at once (each held `hold_s` before its reply, so requests sent together overlap). Binds 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

from in_process_server import InProcessServer


class GenerateServer(InProcessServer):
    """`decodes` maps input ids to the accept length of each verify round (accepted drafts + the bonus token)."""

    def __init__(self, decodes: dict[tuple[int, ...], list[int]], hold_s: float = 0.0) -> None:
        self.decodes = decodes
        self.hold_s = hold_s
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.counting = threading.Lock()
        super().__init__()

    def arrived(self) -> None:
        with self.counting:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def answered(self) -> None:
        with self.counting:
            self.in_flight -= 1

    def reply(self, body: dict[str, Any]) -> dict[str, Any]:
        """The first token from the prefill, then each round's tokens until the budget is spent."""
        budget = body["sampling_params"]["max_new_tokens"]
        emitted, rounds = 1, 0
        for accept_length in self.decodes[tuple(body["input_ids"])]:
            if emitted >= budget:
                break
            rounds += 1
            emitted = min(budget, emitted + accept_length)
        return {"text": "x" * emitted, "meta_info": {
            "id": f"req-{len(self.bodies)}", "prompt_tokens": len(body["input_ids"]), "completion_tokens": emitted,
            "spec_verify_ct": rounds, "cached_tokens": 0, "e2e_latency": 0.01,
            "finish_reason": {"type": "length", "length": budget}}}

    def handler(self) -> type[BaseHTTPRequestHandler]:
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return None

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                scripted.bodies.append(body)
                scripted.arrived()
                time.sleep(scripted.hold_s)
                payload = json.dumps(scripted.reply(body)).encode()
                scripted.answered()
                self.send_response(200 if self.path == "/generate" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        return Handler
