"""A scripted HTTP server on 127.0.0.1 served from a thread of the test process, as a context manager: the base
of the test servers that answer like an engine (tests/test_benchmark.py, tests/sglang_generate_server.py)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

Server = TypeVar("Server", bound="InProcessServer")


class InProcessServer:
    """Binds a free port on 127.0.0.1 with the subclass's `handler()`; serves between enter and exit."""

    def __init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.root_url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def handler(self) -> type[BaseHTTPRequestHandler]:
        raise NotImplementedError

    def __enter__(self: Server) -> Server:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
