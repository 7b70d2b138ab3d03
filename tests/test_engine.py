"""tasks.serving.engine: serving-engine commands, and the process lifecycle against a fake and a real engine.

The fast tests run a fake `vllm.entrypoints.openai.api_server` module (a few lines of http.server, put on
PYTHONPATH) with our own python, so the real command line of `engine_command` is what gets started. The engine-tier
test serves the tiny random Llama with the real vLLM CPU build from `.venv-vllm` (`make serve-env`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from pathlib import Path

import pytest

from tasks.serving.engine import (
    EngineLaunch,
    EngineMissing,
    EngineStartError,
    _port_in_use,
    engine_command,
    free_port,
    metric_total,
    parse_prometheus,
    resolve_python,
    serve,
    serve_together,
    start_engine,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"

FAKE_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="target"} 0.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 3.0
vllm:request_latency_bucket{le="+Inf",model_name="a b}c"} 2 1700000000000
process_open_fds 12
"""

FAKE_SERVER = '''\
"""A fake OpenAI-compatible engine: answers /v1/models and /metrics; behaviour set by FAKE_ENGINE_MODE."""
import http.server, json, os, signal, subprocess, sys, time

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
name = args[args.index("--served-model-name") + 1]
mode = os.environ.get("FAKE_ENGINE_MODE", "serve")
print("fake engine argv:", " ".join(args), flush=True)
print("fake engine CUDA_VISIBLE_DEVICES:", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
if mode == "exit":
    print("fatal: cannot load the model", flush=True)
    sys.exit(3)
if mode == "hang":
    time.sleep(600)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
# A child in the same process group, like vLLM's EngineCore: stop() must take it down too.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"child pid {child.pid}", flush=True)
time.sleep(float(os.environ.get("FAKE_ENGINE_DELAY", "0")))
METRICS = open(os.environ["FAKE_ENGINE_METRICS"], "rb").read()

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/v1/models":
            body, ctype = json.dumps({"object": "list", "data": [{"id": name, "object": "model"}]}).encode(), "application/json"
        elif self.path == "/metrics":
            body, ctype = METRICS, "text/plain; version=0.0.4"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *fmt_args):
        print("request:", fmt % fmt_args, flush=True)

http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def gone(pid: int) -> bool:
    """No such process, or only a zombie waiting for init to reap it (it runs nothing any more)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :].split()[0] == "Z"


def wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    """A non-child process (the fake's own child) is reaped by init a moment after it is killed."""
    deadline = time.monotonic() + timeout_s
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gone(pid)


@pytest.fixture
def fake_engine(tmp_path: Path, subprocesses: None):
    """Factory of launches that start the fake engine through the real vLLM command line."""
    root = tmp_path / "fake-engine"
    package = root / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for directory in (root / "vllm", root / "vllm" / "entrypoints", package):
        (directory / "__init__.py").write_text("")
    (package / "api_server.py").write_text(FAKE_SERVER)
    metrics = tmp_path / "metrics.txt"
    metrics.write_text(FAKE_METRICS)
    model = tmp_path / "model"
    model.mkdir()

    def make(mode: str = "serve", timeout_s: float = 30.0, **env: str) -> EngineLaunch:
        return EngineLaunch(
            kind="vllm",
            model=model,
            python=sys.executable,
            port=free_port(),
            log_path=tmp_path / "logs" / "engine.log",
            env={"PYTHONPATH": str(root), "FAKE_ENGINE_MODE": mode, "FAKE_ENGINE_METRICS": str(metrics), **env},
            startup_timeout_s=timeout_s,
        )

    return make


# --- commands -------------------------------------------------------------------------------------------


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_vllm_command_without_a_draft(tmp_path: Path) -> None:
    launch = EngineLaunch(kind="vllm", model=tmp_path / "t", python="/py", port=8100, log_path=tmp_path / "l")
    command = engine_command(launch)
    assert command[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(command, "--model") == str(tmp_path / "t")
    assert flag(command, "--host") == "127.0.0.1"
    assert flag(command, "--port") == "8100"
    assert flag(command, "--served-model-name") == "target"
    assert flag(command, "--dtype") == "float32"
    assert "--enforce-eager" in command
    assert "--speculative-config" not in command


def test_vllm_command_with_an_eagle3_draft_and_extra_args(tmp_path: Path) -> None:
    launch = EngineLaunch(
        kind="vllm", model=tmp_path / "t", python="/py", port=8100, log_path=tmp_path / "l",
        draft=tmp_path / "d", num_speculative_tokens=5, extra_args=["--dtype", "bfloat16"],
    )  # fmt: skip
    command = engine_command(launch)
    spec = json.loads(flag(command, "--speculative-config"))
    assert spec == {"method": "eagle3", "model": str(tmp_path / "d"), "num_speculative_tokens": 5}
    assert command[-2:] == ["--dtype", "bfloat16"], "extra args come last so they override the defaults"
    assert flag(command, "--host") == "127.0.0.1"


def test_sglang_command_with_and_without_a_draft(tmp_path: Path) -> None:
    launch = EngineLaunch(kind="sglang", model=tmp_path / "t", python="/py", port=30000, log_path=tmp_path / "l")
    plain = engine_command(launch)
    assert plain[:3] == ["/py", "-m", "sglang.launch_server"]
    assert flag(plain, "--model-path") == str(tmp_path / "t")
    assert flag(plain, "--host") == "127.0.0.1" and flag(plain, "--port") == "30000"
    assert "--enable-metrics" in plain and "--speculative-algorithm" not in plain
    assert flag(plain, "--dtype") == "float32", "named: SGLang's auto would load a float32 drafter as float16"
    assert "--disable-cuda-graph" in plain, "the launch's default is the CPU's: eager"

    launch.draft, launch.num_speculative_tokens = tmp_path / "d", 3
    spec = engine_command(launch)
    assert flag(spec, "--speculative-algorithm") == "EAGLE3"
    assert flag(spec, "--speculative-draft-model-path") == str(tmp_path / "d")
    assert flag(spec, "--speculative-num-steps") == "3"
    assert flag(spec, "--speculative-eagle-topk") == "1"
    assert flag(spec, "--speculative-num-draft-tokens") == "4"


def test_a_launch_dtype_reaches_either_engine(tmp_path: Path) -> None:
    """The regenerate stage asks for bfloat16 where the host runs it faster (regeneration.dtype)."""
    for kind in ("vllm", "sglang"):
        launch = EngineLaunch(kind=kind, model=tmp_path / "t", python="/py", port=8100, log_path=tmp_path / "l",
                              dtype="bfloat16")
        assert flag(engine_command(launch), "--dtype") == "bfloat16"
        assert engine_command(launch).count("--dtype") == 1


def test_sglang_command_serves_a_draft_tree_and_vllm_refuses_one(tmp_path: Path) -> None:
    launch = EngineLaunch(kind="sglang", model=tmp_path / "t", python="/py", port=30000, log_path=tmp_path / "l",
                          draft=tmp_path / "d", num_speculative_tokens=5, topk=8, num_draft_tokens=32)
    command = engine_command(launch)
    assert [flag(command, name) for name in ("--speculative-num-steps", "--speculative-eagle-topk",
                                             "--speculative-num-draft-tokens")] == ["5", "8", "32"]
    launch.kind = "vllm"
    with pytest.raises(ValueError, match=r"vLLM's EAGLE3 drafts a chain \(topk 1\); topk 8 is an SGLang draft tree"):
        engine_command(launch)


def test_launch_from_an_engine_config(tmp_path: Path) -> None:
    from contract.config import RunConfig

    engines = RunConfig.model_validate({"output_dir": str(tmp_path)}).runtime.engines
    launch = EngineLaunch.from_config("vllm", engines["vllm"], model=tmp_path / "t", log_path=tmp_path / "l")
    assert launch.python == engines["vllm"].python and launch.port == engines["vllm"].port
    assert launch.env == engines["vllm"].env and launch.startup_timeout_s == engines["vllm"].startup_timeout_s
    assert launch.gpus is None
    placed = EngineLaunch.from_config("vllm", engines["vllm"].model_copy(update={"gpus": "1"}), model=tmp_path / "t",
                                      log_path=tmp_path / "l")
    assert placed.gpus == "1"


def test_relative_engine_python_is_found_from_the_repository_root(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_python(".venv/bin/python") == str(REPO_ROOT / ".venv" / "bin" / "python")
    assert resolve_python(".venv-nope/bin/python") is None


def test_prometheus_text_is_parsed_into_named_series() -> None:
    metrics = parse_prometheus(FAKE_METRICS)
    assert metrics['vllm:num_requests_running{engine="0",model_name="target"}'] == 0.0
    assert metrics['vllm:request_latency_bucket{le="+Inf",model_name="a b}c"}'] == 2.0
    assert metrics["process_open_fds"] == 12.0
    assert metric_total(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == 10.0
    assert metric_total(metrics, "vllm:absent") == 0.0
    assert not any(key.startswith("#") for key in metrics)


# --- lifecycle against the fake engine ------------------------------------------------------------------


def test_start_waits_for_readiness_reads_metrics_and_stops_the_process_group(fake_engine) -> None:
    launch = fake_engine(FAKE_ENGINE_DELAY="1.5")
    started = time.monotonic()
    engine = start_engine(launch)
    try:
        assert time.monotonic() - started >= 1.5, "returned before the server answered"
        assert engine.alive()
        assert engine.base_url == f"http://127.0.0.1:{launch.port}/v1"
        assert engine.metrics_url == f"http://127.0.0.1:{launch.port}/metrics"
        metrics = engine.read_metrics()
        assert metrics['vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"}'] == 3.0
        log = launch.log_path.read_text()
        assert "starting:" in log and "vllm.entrypoints.openai.api_server" in log
        assert "fake engine argv:" in log and "--host 127.0.0.1" in log
        child = int(re.search(r"child pid (\d+)", log).group(1))
    finally:
        code = engine.stop()
    assert code is not None and engine.stop() == code, "stop() is idempotent"
    assert not engine.alive()
    assert gone(engine.pid), "the engine's main process is gone"
    assert wait_gone(child), "its child in the same process group is gone too"


def test_serve_stops_the_engine_when_the_body_raises(fake_engine) -> None:
    with pytest.raises(KeyError):
        with serve(fake_engine()) as engine:
            raise KeyError("boom")
    assert gone(engine.pid)


def test_the_engine_process_sees_only_the_gpus_of_its_launch(fake_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime.engines.<engine>.gpus is the engine's CUDA_VISIBLE_DEVICES, whatever the caller's shell had."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    launch = fake_engine()
    launch.gpus = "2"
    with serve(launch):
        assert "fake engine CUDA_VISIBLE_DEVICES: 2\n" in launch.log_path.read_text()
    inherited = fake_engine()
    with serve(inherited):
        assert "fake engine CUDA_VISIBLE_DEVICES: 0,1,2,3\n" in inherited.log_path.read_text(), "unset: the caller's"


def test_engines_start_together_and_one_failure_stops_the_others(fake_engine) -> None:
    slow = [fake_engine(FAKE_ENGINE_DELAY="1.5") for _ in range(3)]
    started = time.monotonic()
    with serve_together(slow) as engines:
        elapsed = time.monotonic() - started
        assert [engine.launch.port for engine, _ in engines] == [launch.port for launch in slow]
        assert all(engine.alive() and seconds >= 1.5 for engine, seconds in engines)
        assert elapsed < 3 * 1.5, f"three 1.5 s starts overlapped ({elapsed:.1f} s)"
    assert all(gone(engine.pid) for engine, _ in engines)

    healthy = fake_engine()
    with pytest.raises(EngineStartError, match="exited with code 3"):
        with serve_together([healthy, fake_engine("exit")]):
            raise AssertionError("the body must not run when an engine failed to start")
    assert not _port_in_use(healthy.port), "the engine that did start was stopped"


def test_an_engine_that_exits_at_once_raises_with_its_log_tail(fake_engine) -> None:
    launch = fake_engine("exit")
    with pytest.raises(EngineStartError) as error:
        start_engine(launch)
    message = str(error.value)
    assert "exited with code 3" in message
    assert "fatal: cannot load the model" in message, "the log tail is in the message"
    assert "vllm.entrypoints.openai.api_server" in message, "the command is in the message"
    pid = int(re.search(r"pid (\d+)", message).group(1))
    assert gone(pid)


def test_a_missing_engine_environment_says_how_to_create_it(tmp_path: Path) -> None:
    launch = EngineLaunch(
        kind="vllm", model=tmp_path, python=str(tmp_path / ".venv-vllm" / "bin" / "python"), port=free_port(),
        log_path=tmp_path / "engine.log",
    )  # fmt: skip
    with pytest.raises(EngineMissing, match=r"environment is missing.*make serve-env"):
        start_engine(launch)
    assert not launch.log_path.exists(), "nothing was started"


def test_an_engine_that_never_answers_is_killed_after_the_timeout(fake_engine) -> None:
    launch = fake_engine("hang", timeout_s=3.0)
    started = time.monotonic()
    with pytest.raises(EngineStartError, match=r"did not answer GET .*/v1/models within 3 s") as error:
        start_engine(launch)
    assert 3.0 <= time.monotonic() - started < 25.0
    pid = int(re.search(r"pid (\d+)", str(error.value)).group(1))
    assert gone(pid)
    assert "fake engine argv:" in str(error.value)


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(fake_engine) -> None:
    engine = start_engine(fake_engine("ignore-term"))
    started = time.monotonic()
    code = engine.stop(timeout_s=1.0)
    assert code == -9
    assert 1.0 <= time.monotonic() - started < 10.0
    assert gone(engine.pid)


def test_a_busy_port_is_refused_before_starting(fake_engine) -> None:
    launch = fake_engine()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", launch.port))
        sock.listen()
        with pytest.raises(EngineStartError, match="already in use"):
            start_engine(launch)


# --- the real vLLM CPU build ----------------------------------------------------------------------------


@pytest.mark.usefixtures("vllm_python")
def test_vllm_serves_the_tiny_target_greedily_like_transformers(tmp_path: Path, tiny_target_dir: Path) -> None:
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    if not VLLM_PYTHON.is_file():
        pytest.fail(f"the vLLM engine environment is missing ({VLLM_PYTHON}): run `make serve-env`")
    model = tiny_target_dir
    launch = EngineLaunch(
        kind="vllm", model=model, python=str(VLLM_PYTHON), port=free_port(), log_path=tmp_path / "logs" / "vllm.log",
        env={"VLLM_CPU_KVCACHE_SPACE": "1"}, startup_timeout_s=600,
    )  # fmt: skip
    started = time.monotonic()
    with serve(launch) as engine:
        ready_s = time.monotonic() - started
        response = httpx.post(
            f"{engine.base_url}/chat/completions",
            json={
                "model": "target",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0,
                "max_tokens": 8,
                "return_token_ids": True,
            },
            timeout=120,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        message = body["choices"][0]["message"]
        assert message["role"] == "assistant" and isinstance(message["content"], str)
        generated = body["choices"][0]["token_ids"]
        metrics = engine.read_metrics()
        assert any(key.startswith("vllm:") for key in metrics)
        assert metric_total(metrics, "vllm:generation_tokens_total") == len(generated) > 0
        assert metric_total(metrics, "vllm:request_success_total") == 1
    assert gone(engine.pid)
    print(f"vLLM ready in {ready_s:.1f} s")

    # --dtype float32: the served greedy continuation is the one transformers computes from the same prompt.
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    prompt = torch.tensor([body["prompt_token_ids"]])
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=len(generated), do_sample=False)
    assert expected[0, prompt.shape[1] :].tolist() == generated
