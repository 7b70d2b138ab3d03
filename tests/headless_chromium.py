"""Debian's chromium, headless with every network load refused, driven over the Chrome DevTools Protocol.

Used by tests/test_data_docs_offline.py to open Data Docs the way a reader on an air-gapped cluster would:
`--proxy-server` points at a closed port and `--proxy-bypass-list=<-loopback>` sends even loopback through it, so
any http(s) load fails while file:// pages and their relative files load as usual.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
#: Port 9 (discard) is closed here: every proxied request fails at once.
NO_NETWORK_FLAGS = ["--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>"]
START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 60.0


class Page:
    """One browser tab: CDP calls answered in order, and the events that arrived meanwhile kept in `events`."""

    def __init__(self, websocket_url: str) -> None:
        from websockets.sync.client import connect

        self.socket = connect(websocket_url, max_size=None, open_timeout=START_TIMEOUT_S, proxy=None)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        call_id = self.next_id
        self.socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            message = json.loads(self.socket.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"CDP {method} failed: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited); a thrown error fails."""
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Navigate and wait for the load event (scripts run, stylesheets applied, document fonts settled)."""
        self.call("Page.enable")
        self.call("Network.enable")
        self.call("Runtime.enable")
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while self.evaluate("document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not finish loading in {timeout_s} s")
            time.sleep(0.1)
        self.evaluate("document.fonts.ready.then(() => true)")

    def failed_loads(self) -> list[str]:
        """URL and error of each request of this page that failed (a refused network load, a missing file)."""
        requested = {event["params"]["requestId"]: event["params"]["request"]["url"]
                     for event in self.events if event.get("method") == "Network.requestWillBeSent"}
        return [f"{requested.get(event['params']['requestId'], '?')}: {event['params']['errorText']}"
                for event in self.events if event.get("method") == "Network.loadingFailed"]

    def script_errors(self) -> list[str]:
        return [json.dumps(event["params"]["exceptionDetails"])[:500]
                for event in self.events if event.get("method") == "Runtime.exceptionThrown"]

    def close(self) -> None:
        self.socket.close()


class HeadlessChromium:
    """A headless chromium process with its own profile under `profile_dir`, stopped by `close()`."""

    def __init__(self, profile_dir: Path) -> None:
        self.profile_dir = profile_dir
        self.log = open(profile_dir.parent / "chromium.log", "wb")
        self.process = subprocess.Popen(
            [str(CHROMIUM), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--remote-debugging-port=0",
             f"--user-data-dir={profile_dir}", *NO_NETWORK_FLAGS, "about:blank"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.port = self.wait_for_port()

    def wait_for_port(self) -> int:
        """The DevTools port chromium chose (it writes it to DevToolsActivePort once it listens)."""
        marker = self.profile_dir / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.process.returncode}; see {self.log.name}")
            if marker.is_file() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            time.sleep(0.1)
        raise TimeoutError(f"chromium wrote no DevToolsActivePort in {START_TIMEOUT_S} s; see {self.log.name}")

    def page(self) -> Page:
        """The tab chromium opened at start."""
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never an http_proxy of the environment
        with direct.open(f"http://127.0.0.1:{self.port}/json/list", timeout=CALL_TIMEOUT_S) as response:
            targets = json.loads(response.read())
        (tab,) = [target for target in targets if target["type"] == "page"]
        return Page(tab["webSocketDebuggerUrl"])

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
