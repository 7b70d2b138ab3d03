"""Credentials in the run config (contract/secrets.py) never reach a file, the MLflow store or a printout.

The end-to-end test plants a distinctive token in every secret field, runs `eaglet run` on the tiny target
through register against a real MLflow server (HTTP, basic auth in the URI's userinfo) and the real scripted
OpenAI-compatible server, trains on two torchrun ranks, and then reads every byte under the run's output dir and
the MLflow server's directory (sqlite db, artifacts, log) and everything printed: the token is nowhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import mlflow
import pytest
import yaml
from mlflow.utils.credentials import read_mlflow_creds
from typer.testing import CliRunner

from contract.config_loading import ConfigError, config_as_yaml, flatten_config, load_config, validate_config
from contract.secrets import REDACTED, SecretUnavailable, redacted_url, split_userinfo
from flows.cli import app
from pipeline_inputs import tiny_run_config, write_conversations
from tasks.common.artifacts import read_json
from tasks.common.mlflow_store import PASSWORD_VARIABLE, TOKEN_VARIABLE, USERNAME_VARIABLE, tracking_uri
from tasks.data.server_access import server_access
from tasks.regenerate import regeneration_launch
from tasks.serving.engine import EngineLaunch, free_port
from tasks.training.rank_environment import TRACKING_URI_VARIABLE, with_rank_secrets

from chat_server import ChatServer

PLANTED = "eaglet-planted-q7x3"
HF_TOKEN = f"{PLANTED}-hf-token"
ENGINE_TOKEN = f"{PLANTED}-engine-env"
CAPTURE_TOKEN = f"{PLANTED}-capture-engine-env"
API_KEY = f"{PLANTED}-api-key"
HEADER_TOKEN = f"{PLANTED}-header"
BASE_URL_PASSWORD = f"{PLANTED}-base-url"
MLFLOW_PASSWORD = f"{PLANTED}-mlflow"


@pytest.fixture
def clean_mlflow_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLflow credential variables a test hands over are put back as they were afterwards."""
    for variable in (USERNAME_VARIABLE, PASSWORD_VARIABLE, TOKEN_VARIABLE, TRACKING_URI_VARIABLE):
        monkeypatch.delenv(variable, raising=False)


def secret_settings(mlflow_uri: str, server_url: str) -> dict:
    """Config sections with a planted token in every secret field."""
    scheme, _, rest = server_url.partition("://")
    return {
        "regeneration": {"backend": "openai", "base_url": f"{scheme}://reader:{BASE_URL_PASSWORD}@{rest}",
                         "api_key": API_KEY, "headers": {"X-Eaglet-Org": HEADER_TOKEN},
                         "engine_env": {"HF_TOKEN": ENGINE_TOKEN}, "max_new_tokens": 8, "concurrency": 2,
                         "backoff_initial_s": 0.05, "backoff_max_s": 0.5},
        "capture": {"engine_env": {"HF_TOKEN": CAPTURE_TOKEN}},
        "runtime": {"engines": {"vllm": {"python": sys.executable, "env": {"HF_TOKEN": HF_TOKEN}}}},
        "tracking": {"tracking_uri": mlflow_uri, "experiment": "secrets"},
    }


def with_userinfo(url: str, username: str, password: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{username}:{password}@{rest}"


# ------------------------------------------------------------------------------------ redaction, field by field


def test_every_secret_field_is_redacted_where_the_config_is_written(tmp_path: Path) -> None:
    raw = secret_settings(with_userinfo("http://127.0.0.1:5000", "eaglet", MLFLOW_PASSWORD), "http://127.0.0.1:8000/v1")
    cfg = validate_config({"output_dir": str(tmp_path), **raw}, "planted")
    written = config_as_yaml(cfg)
    flat = flatten_config(cfg)
    assert PLANTED not in written and PLANTED not in str(flat) and PLANTED not in repr(cfg.regeneration.api_key)
    assert flat["regeneration.api_key"] == REDACTED and flat["regeneration.headers.X-Eaglet-Org"] == REDACTED
    assert flat["runtime.engines.vllm.env.HF_TOKEN"] == REDACTED and flat["regeneration.engine_env.HF_TOKEN"] == REDACTED
    assert flat["capture.engine_env.HF_TOKEN"] == REDACTED
    assert flat["regeneration.base_url"] == "http://reader:***@127.0.0.1:8000/v1"
    assert flat["tracking.tracking_uri"] == "http://eaglet:***@127.0.0.1:5000"
    assert flat["runtime.engines.vllm.python"] == sys.executable, "what is not secret stays as it was"
    assert redacted_url(f"https://{PLANTED}@host/x") == "https://***@host/x", "a lone token in the userinfo"
    assert redacted_url("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
    assert split_userinfo("http://a:b%40c@h:1/v1").password == "b@c"


def test_a_redacted_copy_runs_what_needs_no_secret_and_names_the_field_that_is_missing(
        tmp_path: Path, clean_mlflow_credentials: None, monkeypatch: pytest.MonkeyPatch) -> None:
    real_uri = with_userinfo("http://127.0.0.1:5000", "eaglet", MLFLOW_PASSWORD)
    cfg = validate_config({"output_dir": str(tmp_path), **secret_settings(real_uri, "http://127.0.0.1:8000/v1")}, "x")
    copy_path = tmp_path / "run.yaml"
    copy_path.write_text(config_as_yaml(cfg))
    copy = load_config(copy_path)
    assert copy.regeneration.max_new_tokens == 8 and copy.output_path == cfg.output_path

    with pytest.raises(SecretUnavailable, match=r"regeneration\.base_url"):
        server_access(copy.regeneration.base_url, copy.regeneration)
    keyless = copy.regeneration.model_copy(update={"base_url": "http://127.0.0.1:8000/v1"})
    with pytest.raises(SecretUnavailable, match=r"regeneration\.api_key"):
        server_access(keyless.base_url, keyless)
    headers_only = keyless.model_copy(update={"api_key": None})
    with pytest.raises(SecretUnavailable, match=r"regeneration\.headers\.X-Eaglet-Org"):
        server_access(headers_only.base_url, headers_only)
    with pytest.raises(SecretUnavailable, match=r"runtime\.engines\.vllm\.env\."):
        EngineLaunch.from_config("vllm", copy.runtime.engines["vllm"], model=tmp_path, log_path=tmp_path / "log")
    engines_in_clear = copy.model_copy(update={"runtime": cfg.runtime, "regeneration": copy.regeneration.model_copy(
        update={"engine": "vllm"})})
    with pytest.raises(SecretUnavailable, match=r"regeneration\.engine_env\.HF_TOKEN"):
        regeneration_launch(engines_in_clear, tmp_path / "log")
    with pytest.raises(SecretUnavailable, match=r"tracking\.tracking_uri"):
        tracking_uri(copy)

    monkeypatch.setenv(TRACKING_URI_VARIABLE, real_uri)
    rank = with_rank_secrets(copy)
    assert tracking_uri(rank) == "http://127.0.0.1:5000", "a rank gets the real URI from its environment"
    assert read_mlflow_creds().username == "eaglet" and read_mlflow_creds().password == MLFLOW_PASSWORD


def test_the_api_key_can_come_from_a_variable_read_when_the_server_is_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, ["regeneration.backend=openai", "regeneration.api_key_env=EAGLET_TEST_API_KEY",
                             "regeneration.base_url=http://127.0.0.1:8000/v1"])
    monkeypatch.delenv("EAGLET_TEST_API_KEY", raising=False)
    with pytest.raises(SecretUnavailable, match="EAGLET_TEST_API_KEY, which is not set"):
        server_access(cfg.regeneration.base_url, cfg.regeneration)
    monkeypatch.setenv("EAGLET_TEST_API_KEY", API_KEY)
    access = server_access(cfg.regeneration.base_url, cfg.regeneration)
    assert access.headers == {"Authorization": f"Bearer {API_KEY}"} and PLANTED not in repr(access)
    assert flatten_config(cfg)["regeneration.api_key_env"] == "EAGLET_TEST_API_KEY", "the name is not secret"
    userinfo = load_config(None, ["regeneration.backend=openai", f"regeneration.base_url=http://u:{API_KEY}@h:1/v1"])
    basic = server_access(userinfo.regeneration.base_url, userinfo.regeneration)
    assert basic.base_url == "http://h:1/v1" and basic.headers["Authorization"].startswith("Basic ")


def test_config_errors_never_show_a_secret_value() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, [f"regeneration.headers={{X-Org: [{PLANTED}]}}", f"runtime.engines.vllm.env.T=[{PLANTED}]"])
    assert "regeneration.headers.X-Org" in str(caught.value) and PLANTED not in str(caught.value)
    with pytest.raises(ConfigError, match="both set"):
        load_config(None, [f"regeneration.api_key={API_KEY}", "regeneration.api_key_env=KEY"])
    with pytest.raises(ConfigError, match="sets Authorization"):
        load_config(None, ["regeneration.api_key_env=KEY", f"regeneration.headers={{authorization: {PLANTED}}}"])


# ------------------------------------------------------------------------------------ the whole pipeline


@dataclass
class MlflowServer:
    directory: Path   # its sqlite db, artifacts and log
    url: str


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[MlflowServer]:
    """`mlflow server` from this venv, sqlite-backed, serving artifacts from its own directory."""
    directory = tmp_path / "mlflow-server"
    directory.mkdir()
    port = free_port()
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
               "--artifacts-destination", str(directory / "mlartifacts"), "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    with open(directory / "server.log", "wb") as log:
        process = subprocess.Popen(command, cwd=directory, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = MlflowServer(directory, f"http://127.0.0.1:{port}")
    try:
        wait_until_healthy(server, process)
        yield server
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)


def wait_until_healthy(server: MlflowServer, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mlflow server exited: {(server.directory / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("mlflow server did not become healthy")


@pytest.fixture
def chat_server(tiny_target_dir: Path) -> Iterator[ChatServer]:
    server = ChatServer(tiny_target_dir, free_port())
    yield server
    server.stop()


def files_holding(needle: bytes, *roots: Path) -> list[str]:
    """Every file under `roots` whose bytes contain `needle`."""
    hits = []
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file() and needle in path.read_bytes():
                hits.append(str(path))
    return hits


def test_no_planted_secret_reaches_a_file_the_mlflow_store_or_a_printout(
        prefect_harness, tmp_path: Path, tiny_target_dir: Path, mlflow_server: MlflowServer, chat_server: ChatServer,
        clean_mlflow_credentials: None, capfd: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    chats = write_conversations(tmp_path / "inputs" / "chats.jsonl")
    mlflow_uri = with_userinfo(mlflow_server.url, "eaglet", MLFLOW_PASSWORD)
    config = tiny_run_config(str(out), tiny_target_dir, str(chats), {})
    for section, values in secret_settings(mlflow_uri, chat_server.url).items():
        config[section] = {**config.get(section, {}), **values}
    config["deployment"] = {"trainer": {"nproc_per_node": 2}}
    config_path = tmp_path / "run.yaml"   # the one file that holds the secrets: the user's own, outside output_dir
    config_path.write_text(yaml.safe_dump(config))

    probes = len(chat_server.request_headers())  # the fixture's own readiness check
    ran = CliRunner().invoke(app, ["run", "--config", str(config_path)])
    assert ran.exit_code == 0, ran.output
    shown = CliRunner().invoke(app, ["config", "show", "--config", str(config_path)])
    assert shown.exit_code == 0 and "api_key: '***'" in shown.output
    printed = capfd.readouterr()
    assert files_holding(PLANTED.encode(), out, mlflow_server.directory) == []
    for name, text in (("eaglet run", ran.output), ("eaglet config show", shown.output),
                       ("stdout", printed.out), ("stderr", printed.err)):
        assert PLANTED not in text, f"{name} printed a planted secret"

    registration = read_json(out / "register" / "registration.json")
    assert registration["version"] == 1, "registered in the MLflow server"
    assert (out / "train" / "launch.yaml").is_file() and read_json(out / "train" / "summary.json")["world_size"] == 2
    client = mlflow.MlflowClient(tracking_uri=mlflow_server.url)
    experiment = client.get_experiment_by_name("secrets")
    (pipeline_run,) = client.search_runs([experiment.experiment_id], "tags.\"eaglet.kind\" = 'pipeline'")
    (training_run,) = client.search_runs([experiment.experiment_id], "tags.\"eaglet.stage\" = 'train'")
    assert training_run.data.tags["mlflow.parentRunId"] == pipeline_run.info.run_id, "rank 0 logged to the server"
    assert pipeline_run.data.params["tracking.tracking_uri"] == with_userinfo(mlflow_server.url, "eaglet", REDACTED)
    assert pipeline_run.data.params["regeneration.api_key"] == REDACTED
    credentials = read_mlflow_creds()
    assert (credentials.username, credentials.password) == ("eaglet", MLFLOW_PASSWORD), "MLflow got the credentials"

    requests = chat_server.request_headers()[probes:]
    assert any(request["path"] == "/v1/chat/completions" for request in requests)
    for request in requests:
        assert request["headers"].get("authorization") == f"Bearer {API_KEY}", request["path"]
        assert request["headers"].get("x-eaglet-org") == HEADER_TOKEN, request["path"]
