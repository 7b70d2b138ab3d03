"""Engine start-up failures, classed by whether a retry can cure them (flows/pipeline.py `is_transient`).

Each class is produced by a real process started through the real vLLM command line: a fake `vllm` package on the
engine's PYTHONPATH whose api_server parses its flags with argparse, binds its port and answers `/v1/models`, or
sleeps without ever answering.
"""

from __future__ import annotations

import re
import socket
import sys
from pathlib import Path

import pytest

from flows.pipeline import is_transient
from tasks.serving.engine import (EngineExited, EngineLaunch, EngineNotReady, EnginePortTaken, exit_reason,
                                  free_port, start_engine)

#: A fake api_server: vLLM's flags eaglet passes, argparse's usage error for any other, then a real bind.
ARGPARSE_ENGINE = '''\
import argparse, http.server, json, os, time
parser = argparse.ArgumentParser(prog="api_server")
for name in ("--model", "--host", "--port", "--served-model-name", "--dtype"):
    parser.add_argument(name)
parser.add_argument("--enforce-eager", action="store_true")
args = parser.parse_args()
if os.environ.get("FAKE_ENGINE_MODE") == "hang":
    print("loading the model, slowly", flush=True)
    time.sleep(600)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": args.served_model_name}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

http.server.HTTPServer((args.host, int(args.port)), Handler).serve_forever()
'''


@pytest.fixture
def argparse_engine(tmp_path: Path, subprocesses: None):
    """Factory of launches of ARGPARSE_ENGINE on a free port."""
    package = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for directory in (package.parent.parent, package.parent, package):
        (directory / "__init__.py").write_text("")
    (package / "api_server.py").write_text(ARGPARSE_ENGINE)
    (tmp_path / "model").mkdir()

    def make(*extra_args: str, mode: str = "serve", timeout_s: float = 60.0, port: int | None = None) -> EngineLaunch:
        return EngineLaunch(kind="vllm", model=tmp_path / "model", python=sys.executable, port=port or free_port(),
                            log_path=tmp_path / "logs" / "engine.log", extra_args=list(extra_args),
                            env={"PYTHONPATH": str(tmp_path / "site"), "FAKE_ENGINE_MODE": mode},
                            startup_timeout_s=timeout_s)

    return make


def test_an_engine_that_exits_on_a_bad_flag_fails_at_once_naming_the_reason_and_the_log(argparse_engine) -> None:
    launch = argparse_engine("--no-such-flag")
    with pytest.raises(EngineExited) as raised:
        start_engine(launch)
    message = str(raised.value)
    assert "exited with code 2" in message
    reason = message.split("before becoming ready: ", 1)[1].split(" (not retried", 1)[0]
    assert reason == "api_server: error: unrecognized arguments: --no-such-flag", "the log's error line is the reason"
    assert f"log: {launch.log_path}" in message and str(launch.log_path) in message.split("\n", 1)[0]
    assert not is_transient(raised.value), "the same command would exit again: not retried"


def test_a_port_already_listened_on_fails_at_once_and_a_free_one_is_suggested(argparse_engine) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        launch = argparse_engine(port=taken)
        with pytest.raises(EnginePortTaken) as raised:
            start_engine(launch)
    message = str(raised.value)
    assert f"port 127.0.0.1:{taken} is already in use" in message and "runtime.engines.vllm.port" in message
    suggested = int(re.search(r"e\.g\. (\d+), free a moment ago", message).group(1))
    assert suggested != taken
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", suggested))  # the suggestion is a port one can bind
    assert not launch.log_path.exists(), "nothing was started"
    assert not is_transient(raised.value), "the port stays taken until its holder lets go"


def test_a_port_taken_between_the_check_and_the_bind_is_read_from_the_log(argparse_engine) -> None:
    """A bound socket that does not listen passes the connect check, but the engine's own bind fails."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        taken = holder.getsockname()[1]
        with pytest.raises(EnginePortTaken) as raised:
            start_engine(argparse_engine(port=taken))
    message = str(raised.value)
    assert f"port 127.0.0.1:{taken} is already in use" in message and "Address already in use" in message
    assert not is_transient(raised.value)


def test_an_engine_alive_but_not_ready_in_time_is_worth_a_retry(argparse_engine) -> None:
    with pytest.raises(EngineNotReady) as raised:
        start_engine(argparse_engine(mode="hang", timeout_s=1.5))
    assert "did not answer GET" in str(raised.value) and "loading the model, slowly" in str(raised.value)
    assert is_transient(raised.value), "a slow load may be faster next time"


def test_the_exit_reason_is_the_last_error_line_of_the_log() -> None:
    tail = ("INFO loading weights\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
            "INFO shutting down\n")
    assert exit_reason(tail) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert exit_reason("INFO only this\n") == "INFO only this", "no error line: the last line"
    assert exit_reason("") == "it wrote nothing to its log"
