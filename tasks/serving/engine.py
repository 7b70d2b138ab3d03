"""Run an OpenAI-compatible serving engine (vLLM or SGLang) as a separate process from its own environment.

The engine never shares our venv (its wheel pins its own torch/transformers; docs/architecture.md §6): it is
started with the `python` of its own virtualenv (`make serve-env` creates `.venv-vllm`), in a new session (setsid) so
the whole process tree can be stopped by process group, bound to 127.0.0.1 only, with stdout+stderr kept in
a log file. Readiness is `GET /v1/models` answering 200 within the start-up timeout; any failure to become
ready stops the process tree and raises `EngineStartError` with the command, the exit code and the log tail;
a missing python, model or draft raises its subclass `EngineMissing` before anything starts. Only a readiness
timeout of a live process (`EngineNotReady`) is worth a retry; an engine that exited (`EngineExited`: bad flag,
import error, out of memory at load, its reason read from the log tail) or whose port is taken (`EnginePortTaken`)
fails the same way again, so the stage fails at once (`retry_can_cure`).

    with serve(EngineLaunch(kind="vllm", model=target_dir, python=".venv-vllm/bin/python",
                            port=free_port(), log_path=out / "logs/vllm.log")) as engine:
        httpx.post(f"{engine.base_url}/chat/completions", json={"model": "target", ...})
        engine.read_metrics()   # {'vllm:generation_tokens_total{engine="0",model_name="target"}': 8.0, ...}
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Literal, Mapping, Optional

from contract.secrets import unredacted_mapping
from tasks.serving.serving_setting import export_method, vllm_speculative_config

EngineKind = Literal["vllm", "sglang"]

HOST = "127.0.0.1"
LOG_TAIL_LINES = 40
POLL_INTERVAL_S = 0.5
#: Where `EngineLaunch.gpus` goes in the engine's environment.
GPU_VARIABLE = "CUDA_VISIBLE_DEVICES"
#: Lower-case fragments of the log line that says why an engine exited at start-up (tasks/serving/engine.py
#: `exit_reason`), and the one that means its port was taken between our check and its bind.
EXIT_REASON_MARKERS = ("error", "out of memory", "exception", "killed")
PORT_TAKEN_MARKER = "address already in use"

#: How to create each engine's environment when its python is missing.
ENV_HINTS: dict[str, str] = {
    "vllm": "run `make serve-env` (creates .venv-vllm with the vLLM CPU build)",
    "sglang": "create a virtualenv with `pip install sglang` on a GPU node and point runtime.engines.sglang.python at it "
    "(SGLang cannot serve on CPUs without AVX-512/AMX builds; on CPU use vLLM: `make serve-env`)",
}

#: Environment defaults per engine, applied only where neither os.environ nor `EngineLaunch.env` sets them.
#: Without VLLM_CPU_KVCACHE_SPACE the vLLM CPU build reserves a large fraction of host RAM for its KV cache.
DEFAULT_ENV: dict[str, dict[str, str]] = {
    "vllm": {"VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONUNBUFFERED": "1"},
    "sglang": {"PYTHONUNBUFFERED": "1"},
}

_REPO_ROOT = Path(__file__).resolve().parents[2]


class EngineStartError(RuntimeError):
    """The engine could not be started or did not become ready. `retry_can_cure` says whether starting it again
    may succeed: flows/pipeline.py retries a stage only for those."""

    retry_can_cure = True


class EngineNotReady(EngineStartError):
    """The engine process is alive but did not answer within its start-up timeout (a slow load, a busy GPU host):
    a later try may find it faster."""


class EngineMissing(EngineStartError):
    """What the engine needs is not there (its python, the model or the draft directory): a retry cannot help."""

    retry_can_cure = False


class EngineExited(EngineStartError):
    """The engine process exited before it was ready (a bad flag, an import error, out of memory while loading
    the model): started again with the same command, it exits again."""

    retry_can_cure = False


class EnginePortTaken(EngineStartError):
    """Something else listens on the engine's port: it stays taken until whoever holds it lets go."""

    retry_can_cure = False


@dataclass
class EngineLaunch:
    """Everything needed to start one engine process.

    `python` is the interpreter of the engine's own virtualenv; a relative path is looked up from the
    current directory, then from the repository root. `extra_args` are appended last, so they override the
    defaults of `engine_command` (e.g. `["--max-model-len", "4096"]`). `env` is added to os.environ; `gpus` becomes
    the engine's CUDA_VISIBLE_DEVICES. The defaults of `dtype` and `enforce_eager` are the CPU's (float32, eager):
    tasks/serving/engine_settings.py resolves a run's from runtime.engines.<kind>.
    """

    kind: EngineKind
    model: Path
    python: str
    port: int
    log_path: Path
    draft: Optional[Path] = None
    num_speculative_tokens: int = 3
    topk: int = 1                    # > 1: an SGLang draft tree (vLLM drafts chains only)
    num_draft_tokens: Optional[int] = None   # SGLang: tokens verified per round (None: steps + 1 for a chain)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # secret values (contract/secrets.py)
    startup_timeout_s: float = 600.0
    served_model_name: str = "target"
    dtype: str = "float32"           # --dtype of the target and the drafter, on either engine (engine_command)
    enforce_eager: bool = True       # no CUDA graphs: vLLM --enforce-eager, SGLang --disable-cuda-graph
    gpus: Optional[str] = None       # CUDA_VISIBLE_DEVICES of the engine's process; None: inherited

    @classmethod
    def from_config(
        cls,
        kind: EngineKind,
        engine: Any,
        *,
        model: Path,
        log_path: Path,
        draft: Optional[Path] = None,
        num_speculative_tokens: int = 3,
        topk: int = 1,
        num_draft_tokens: Optional[int] = None,
        served_model_name: str = "target",
    ) -> "EngineLaunch":
        """Build a launch from a `contract.config.EngineConfig` (python, port, extra_args, env, startup_timeout_s,
        gpus); an env value read back as `***` from a redacted config is refused, naming it."""
        return cls(
            kind=kind,
            model=Path(model),
            python=engine.python,
            port=engine.port,
            log_path=Path(log_path),
            draft=Path(draft) if draft is not None else None,
            num_speculative_tokens=num_speculative_tokens,
            topk=topk,
            num_draft_tokens=num_draft_tokens,
            extra_args=list(engine.extra_args),
            env=unredacted_mapping(engine.env, f"runtime.engines.{kind}.env"),
            startup_timeout_s=engine.startup_timeout_s,
            served_model_name=served_model_name,
            gpus=engine.gpus,
        )


def engine_command(launch: EngineLaunch) -> list[str]:
    """The argv that starts the engine, bound to 127.0.0.1, with EAGLE3 speculative decoding when `draft` is set.

    `--dtype` is always named, for the target and the drafter alike: neither engine has a draft dtype of its own
    (SGLang's draft worker reads the server's --dtype, vLLM's draft inherits the target's), and SGLang's `auto` turns a
    float32 config into float16, which beside a bfloat16 target fails its kernels. The CPU defaults (float32, eager)
    keep greedy outputs token for token those of the local transformers backend; `enforce_eager` skips vLLM's
    torch.compile and CUDA graphs (ready in seconds) or SGLang's CUDA graphs.
    """
    n = launch.num_speculative_tokens
    if n < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {n}")
    if launch.draft is not None and launch.topk > 1 and launch.kind == "vllm":
        raise ValueError(f"vLLM's EAGLE3 drafts a chain (topk 1); topk {launch.topk} is an SGLang draft tree")
    if launch.kind == "vllm":
        command = [
            launch.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(launch.model),
            "--host", HOST,
            "--port", str(launch.port),
            "--served-model-name", launch.served_model_name,
            *(["--enforce-eager"] if launch.enforce_eager else []),
            "--dtype", launch.dtype,
        ]  # fmt: skip
        if launch.draft is not None:
            spec = vllm_speculative_config(export_method(launch.draft), n, model=str(launch.draft))
            command += ["--speculative-config", json.dumps(spec)]
    elif launch.kind == "sglang":
        command = [
            launch.python, "-m", "sglang.launch_server",
            "--model-path", str(launch.model),
            "--host", HOST,
            "--port", str(launch.port),
            "--served-model-name", launch.served_model_name,
            "--enable-metrics",
            "--dtype", launch.dtype,
            *(["--disable-cuda-graph"] if launch.enforce_eager else []),
        ]  # fmt: skip
        if launch.draft is not None:
            command += [
                "--speculative-algorithm", "EAGLE3",
                "--speculative-draft-model-path", str(launch.draft),
                "--speculative-num-steps", str(n),
                "--speculative-eagle-topk", str(launch.topk),
                "--speculative-num-draft-tokens", str(launch.num_draft_tokens or n + 1),
            ]  # fmt: skip
    else:
        raise ValueError(f"unknown engine kind {launch.kind!r}; expected 'vllm' or 'sglang'")
    return command + list(launch.extra_args)


def engine_environment(launch: EngineLaunch, inherited: Mapping[str, str]) -> dict[str, str]:
    """The engine process's environment: the engine's defaults, then `inherited` (our own), then `launch.env`,
    and `launch.gpus` as CUDA_VISIBLE_DEVICES over whatever the caller's shell had (placement is deliberate)."""
    env = {**DEFAULT_ENV.get(launch.kind, {}), **inherited, **launch.env}
    if launch.gpus is not None:
        if GPU_VARIABLE in launch.env:
            raise ValueError(f"runtime.engines.{launch.kind}.gpus ({launch.gpus}) and CUDA_VISIBLE_DEVICES in the "
                             "engine's env both place the engine: keep gpus")
        env[GPU_VARIABLE] = launch.gpus
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def resolve_python(python: str) -> Optional[str]:
    """The engine interpreter as an absolute path, or None when it does not exist.

    A bare name (`python3`) is looked up on PATH; a relative path is tried from the current directory, then
    from the repository root (so `.venv-vllm/bin/python` works from anywhere).
    """
    import shutil

    if os.sep not in python:
        return shutil.which(python)
    path = Path(python).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, _REPO_ROOT / path]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate.absolute())
    return None


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition → {'name{labels}': value}; `name` alone when a sample has no labels."""
    metrics: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            end = _closing_brace(line, brace)
            if end == -1:
                continue
            key, rest = line[: end + 1], line[end + 1 :]
        else:
            if space == -1:
                continue
            key, rest = line[:space], line[space:]
        fields = rest.split()
        if not fields:
            continue
        try:
            metrics[key] = float(fields[0])
        except ValueError:
            continue
    return metrics


def _closing_brace(line: str, start: int) -> int:
    """Index of the `}` closing the label set opened at `start`, skipping quoted label values."""
    in_quotes = escaped = False
    for i in range(start + 1, len(line)):
        char = line[i]
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            in_quotes = not in_quotes
        elif char == "}" and not in_quotes:
            return i
    return -1


def metric_total(metrics: dict[str, float], name: str) -> float:
    """Sum of every series of metric `name` (all label sets), 0.0 when absent."""
    return sum(value for key, value in metrics.items() if key == name or key.startswith(name + "{"))


def _http_get(url: str, timeout_s: float) -> tuple[int, bytes]:
    """GET without any proxy (the engine is on 127.0.0.1); returns (status, body)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _tail(path: Path, offset: int = 0, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])


_RUNNING: "weakref.WeakSet[RunningEngine]" = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    """Never leave an engine running after our interpreter exits normally."""
    for engine in list(_RUNNING):
        engine.stop(timeout_s=10)


class RunningEngine:
    """A started, ready engine process (leader of its own process group)."""

    def __init__(self, launch: EngineLaunch, command: list[str], process: subprocess.Popen, log_offset: int = 0):
        self.launch = launch
        self.command = command
        self.process = process
        self.log_offset = log_offset
        self.port = launch.port
        self.root_url = f"http://{HOST}:{launch.port}"
        self.base_url = f"{self.root_url}/v1"
        self.metrics_url = f"{self.root_url}/metrics"
        self._stopped = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log_path(self) -> Path:
        return self.launch.log_path

    def alive(self) -> bool:
        """True while the engine's main process has not exited."""
        return self.process.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines this engine wrote to its log."""
        return _tail(self.log_path, self.log_offset, lines)

    def read_metrics(self, timeout_s: float = 10.0) -> dict[str, float]:
        """GET /metrics and parse it into {'name{labels}': value}."""
        status, body = _http_get(self.metrics_url, timeout_s)
        if status != 200:
            raise RuntimeError(f"GET {self.metrics_url} answered {status}: {body[:200]!r}")
        return parse_prometheus(body.decode("utf-8", errors="replace"))

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        """SIGTERM the whole process group, SIGKILL what is left after `timeout_s`; returns the exit code.

        Idempotent: a second call only returns the exit code (it never signals a process group id again).
        """
        if self._stopped:
            return self.process.returncode
        self._stopped = True
        pgid = self.process.pid  # start_new_session=True: the leader's pid is the group id
        deadline = time.monotonic() + timeout_s
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        # The leader may be gone while its children (vLLM's EngineCore, workers) still shut down.
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
        code = self.process.wait()
        _wait_group_gone(pgid, 5.0)
        _RUNNING.discard(self)
        return code

    def __repr__(self) -> str:
        return f"RunningEngine(kind={self.launch.kind!r}, pid={self.pid}, base_url={self.base_url!r})"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_members(pgid: int) -> Optional[list[int]]:
    """Live (non-zombie) processes of a process group from /proc; None where /proc cannot tell."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        return None
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _group_alive(pgid: int) -> bool:
    """True while any process of the group is still running (zombies waiting for a reaper do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    members = _group_members(pgid)
    return True if members is None else bool(members)


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((HOST, port)) == 0


def start_engine(launch: EngineLaunch) -> RunningEngine:
    """Start the engine and wait until `GET /v1/models` answers 200; raise EngineStartError otherwise."""
    python = resolve_python(launch.python)
    if python is None:
        hint = ENV_HINTS.get(launch.kind, "create the engine's virtualenv")
        raise EngineMissing(
            f"the {launch.kind} engine environment is missing: {launch.python!r} is not an executable python "
            f"(looked in {Path.cwd()} and {_REPO_ROOT}); {hint}"
        )
    if not Path(launch.model).exists():
        raise EngineMissing(f"model directory {launch.model} does not exist")
    if launch.draft is not None and not Path(launch.draft).exists():
        raise EngineMissing(f"draft model directory {launch.draft} does not exist")
    if _port_in_use(launch.port):
        raise EnginePortTaken(_port_taken(launch))

    command = engine_command(dataclasses.replace(launch, python=python))
    env = engine_environment(launch, os.environ)

    log_path = Path(launch.log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        offset = log.tell()
        log.write(f"=== eaglet: {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {_shell(command)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    engine = RunningEngine(launch, command, process, log_offset=offset)
    _RUNNING.add(engine)

    deadline = time.monotonic() + launch.startup_timeout_s
    ready_url = f"{engine.base_url}/models"
    while True:
        code = process.poll()
        if code is not None:
            engine.stop(timeout_s=5)
            raise _exited(engine, code)
        try:
            status, _ = _http_get(ready_url, timeout_s=5.0)
            if status == 200 and process.poll() is None:
                return engine
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() >= deadline:
            engine.stop(timeout_s=10)
            raise EngineNotReady(
                _failure(engine, f"did not answer GET {ready_url} within {launch.startup_timeout_s:g} s; stopped it")
            )
        time.sleep(POLL_INTERVAL_S)


def _shell(command: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(part) for part in command)


def _port_taken(launch: EngineLaunch) -> str:
    return (f"port {HOST}:{launch.port} is already in use; stop what listens there or pick another port "
            f"(runtime.engines.{launch.kind}.port), e.g. {free_port()}, free a moment ago")


def exit_reason(log_tail: str) -> str:
    """The line of an engine's log that says why it exited: the last one naming an error (an argparse usage
    error, a Python exception, CUDA out of memory), else its last line."""
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    for line in reversed(lines):
        lowered = line.lower()
        if any(marker in lowered for marker in EXIT_REASON_MARKERS):
            return line
    return lines[-1] if lines else "it wrote nothing to its log"


def _exited(engine: RunningEngine, code: int) -> EngineStartError:
    """An engine that exited before it was ready: its port was taken after all (the bind failed), or it would
    exit again however often it is started."""
    reason = exit_reason(engine.log_tail())
    if PORT_TAKEN_MARKER in reason.lower():
        return EnginePortTaken(f"{_port_taken(engine.launch)}\n{_failure(engine, f'exited with code {code}')}")
    what = (f"exited with code {code} before becoming ready: {reason} (not retried: the same command would exit "
            f"again; the log {engine.log_path} says why)")
    return EngineExited(_failure(engine, what))


def _failure(engine: RunningEngine, what: str) -> str:
    return (
        f"{engine.launch.kind} engine (pid {engine.pid}) {what}\n"
        f"command: {_shell(engine.command)}\n"
        f"log: {engine.log_path}\n"
        f"--- last {LOG_TAIL_LINES} log lines ---\n{engine.log_tail()}"
    )


@contextmanager
def serve(launch: EngineLaunch) -> Iterator[RunningEngine]:
    """Start the engine, yield it once ready, and always stop it (and its whole process group)."""
    engine = start_engine(launch)
    try:
        yield engine
    finally:
        engine.stop()


@contextmanager
def serve_together(launches: list[EngineLaunch]) -> Iterator[list[tuple[RunningEngine, float]]]:
    """Start several engines at once (each start is mostly imports in its own processes, so they overlap), yield
    (engine, seconds until it was ready) in launch order, and always stop every one that started. When one
    fails to start, the others are stopped and its EngineStartError is raised."""
    def timed_start(launch: EngineLaunch) -> tuple[RunningEngine, float]:
        started = time.monotonic()
        return start_engine(launch), time.monotonic() - started

    ready: list[tuple[RunningEngine, float]] = []
    problems: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=max(1, len(launches))) as pool:
        for future in [pool.submit(timed_start, launch) for launch in launches]:
            try:
                ready.append(future.result())
            except BaseException as problem:  # every start is waited for, so none is left running unowned
                problems.append(problem)
    try:
        if problems:
            raise problems[0]
        yield ready
    finally:
        for engine, _ in ready:
            engine.stop()
