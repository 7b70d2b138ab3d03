"""tests/openai_server.py run as a real process on 127.0.0.1, and what it saw (shared by the OpenAI-backend tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

TESTS = Path(__file__).resolve().parent


class ChatServer:
    """tests/openai_server.py as a real process on 127.0.0.1."""

    def __init__(self, model_dir: Path, port: int, *options: str) -> None:
        self.url = f"http://127.0.0.1:{port}/v1"
        command = [sys.executable, str(TESTS / "openai_server.py"), "--model", str(model_dir), "--port", str(port), *options]
        self.process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/models", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("test server did not start")

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url.removesuffix("/v1") + "/stats").json()

    def chat_requests(self) -> int:
        return self.stats()["chat_requests"]

    def arrivals(self) -> list[str]:
        """The last message of every chat request, in the order the server received them."""
        return self.stats()["arrivals"]

    def request_headers(self) -> list[dict[str, Any]]:
        """Path and headers (lower-cased names) of every request but /stats, in arrival order."""
        return self.stats()["request_headers"]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
