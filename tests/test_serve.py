"""`eaglet serve` on a real sqlite MLflow store holding a real registered tiny drafter (tests/test_register.py's
fixtures): the command line it would run, the versions it refuses, and the tiny version served on vLLM's CPU build.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlflow
import pytest
import typer
import yaml
from typer.testing import CliRunner

from contract.config import RunConfig
from contract.config_loading import config_as_yaml
from flows.serve_cli import add_serve_command
from tasks import register
from tasks.registry.store import TAG_RECOMMENDED_SERVING
from tasks.serving.serve_version import recommended_setting
from tasks.serving.serving_setting import ServingSetting
from test_register import MODEL, exported_run, run_copy  # noqa: F401  (exported_run: a module fixture)

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE_PYTHON = "/opt/engines/vllm/bin/python"


def registered(exported: RunConfig, tmp_path: Path, mlflow_uri: str, engines: dict[str, Any]) -> tuple[RunConfig, Path]:
    """Version 1 of MODEL registered as champion from a copy of the exported run; its config file, serving with
    `engines` (runtime.engines)."""
    cfg = run_copy(exported, tmp_path / "out", mlflow_uri)
    register.run(cfg)
    cfg = RunConfig.model_validate({**cfg.model_dump(mode="json"), "runtime": {"engines": engines}})
    written = yaml.safe_load(config_as_yaml(cfg))
    for kind, engine in engines.items():  # a written config keeps secrets redacted; this one holds the real values
        written["runtime"]["engines"][kind]["env"] = engine.get("env", {})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(written))
    return cfg, config


def recommend(mlflow_uri: str, value: Any) -> None:
    tag = value if isinstance(value, str) else json.dumps(value)
    mlflow.MlflowClient(mlflow_uri).set_model_version_tag(MODEL, "1", TAG_RECOMMENDED_SERVING, tag)


def invoke(*arguments: str) -> Any:
    app = typer.Typer()
    add_serve_command(app)
    app.command("unused")(lambda: None)  # two commands: `serve` stays a subcommand, as in the eaglet app
    return CliRunner().invoke(app, list(arguments), env={"COLUMNS": "220"})


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.fixture
def no_git(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The register stage's provenance asks git; a unit test registers without it."""
    monkeypatch.setattr(register, "git_output", lambda *arguments, **options: None)
    monkeypatch.chdir(tmp_path)


@pytest.mark.usefixtures("no_git")
def test_print_gives_the_vllm_command_of_the_registered_version(exported_run: RunConfig, tmp_path: Path,  # noqa: F811
                                                                 mlflow_uri: str) -> None:
    engines = {"vllm": {"python": ENGINE_PYTHON, "port": 8123, "extra_args": ["--max-model-len", "256"]}}
    cfg, config = registered(exported_run, tmp_path, mlflow_uri, engines)
    recommend(mlflow_uri, {"vllm": {"method": "eagle3", "num_speculative_tokens": 2, "steps": 2, "topk": 1,
                                    "num_draft_tokens": 3, "speedup": 1.3}})

    printed = invoke("serve", "--alias", "champion", "--print", "--config", str(config),
                     "runtime.engines.vllm.env={HF_TOKEN: s3cret}")
    assert printed.exit_code == 0, printed.output
    lines = printed.stdout.splitlines()  # MLflow's download progress is on stderr
    command = shlex.split(lines[-1])
    export = cfg.output_path / "serve" / "v1" / "vllm"
    assert command[:3] == [ENGINE_PYTHON, "-m", "vllm.entrypoints.openai.api_server"]
    assert option(command, "--model") == str(cfg.output_path / "target") and option(command, "--port") == "8123"
    assert json.loads(option(command, "--speculative-config")) == {"method": "eagle3", "model": str(export),
                                                                   "num_speculative_tokens": 2}
    assert command[-2:] == ["--max-model-len", "256"], "runtime.engines.vllm.extra_args, last"
    assert lines[0] == f"# {MODEL} v1 (alias 'champion') on vllm: k2 from eaglet.recommended_serving (vllm: k2)"
    assert lines[2:-1] == ["export PYTHONUNBUFFERED=1",  # the engine's own default (tasks/serving/engine.py)
                           "export VLLM_CPU_KVCACHE_SPACE=***  # runtime.engines.vllm.env.VLLM_CPU_KVCACHE_SPACE (secret)",
                           "export HF_TOKEN=***  # runtime.engines.vllm.env.HF_TOKEN (secret)"]
    assert "s3cret" not in printed.output, "env values are secrets: named, never printed"
    for name in ("config.json", "contract.json", "model.safetensors"):
        assert (export / name).read_bytes() == (cfg.output_path / "draft" / "vllm" / name).read_bytes(), name

    recommend(mlflow_uri, "not measured")  # a version registered without a benchmark
    fallback = invoke("serve", "--version", "1", "--port", "9001", "--print", "--config", str(config))
    assert fallback.exit_code == 0, fallback.output
    command = shlex.split(fallback.stdout.splitlines()[-1])
    assert json.loads(option(command, "--speculative-config"))["num_speculative_tokens"] == cfg.evaluation.steps == 3
    assert option(command, "--port") == "9001"
    assert "k3 from eaglet.recommended_serving is 'not measured': evaluation.steps chain (3)" in fallback.output

    redacted = invoke("serve", "--print", "--config", str(config), "runtime.engines.vllm.env={HF_TOKEN: '***'}")
    assert redacted.exit_code == 1 and "runtime.engines.vllm.env.HF_TOKEN reads '***'" in redacted.output

    assert option(command, "--dtype") == "float32" and "--enforce-eager" in command, "this CPU run's: named"
    sglang = invoke("serve", "--engine", "sglang", "--print", "--config", str(config), "runtime.device=cuda",
                    "runtime.engines.sglang.gpus=1")
    assert sglang.exit_code == 0, sglang.output
    command = shlex.split(sglang.stdout.splitlines()[-1])
    assert command[1:3] == ["-m", "sglang.launch_server"] and option(command, "--speculative-algorithm") == "EAGLE3"
    assert option(command, "--dtype") == "float32" and "--disable-cuda-graph" not in command, "model.dtype, graphs"
    assert "export CUDA_VISIBLE_DEVICES=1  # runtime.engines.sglang.gpus" in sglang.stdout.splitlines()
    assert option(command, "--speculative-draft-model-path") == str(cfg.output_path / "serve" / "v1" / "sglang")
    assert [option(command, name) for name in ("--speculative-num-steps", "--speculative-eagle-topk",
                                               "--speculative-num-draft-tokens")] == ["3", "1", "4"]
    both = invoke("serve", "--alias", "champion", "--version", "1", "--print", "--config", str(config))
    assert both.exit_code == 2


@pytest.mark.usefixtures("no_git")
def test_a_version_trained_for_another_target_is_refused_naming_the_field(exported_run: RunConfig,  # noqa: F811
                                                                          tmp_path: Path, mlflow_uri: str) -> None:
    cfg, config = registered(exported_run, tmp_path, mlflow_uri, {"vllm": {"python": ENGINE_PYTHON}})
    target_json = cfg.output_path / "target.json"
    served = json.loads(target_json.read_text())
    target_json.write_text(json.dumps({**served, "hidden_size": 32, "revision": "another-revision"}))

    refused = invoke("serve", "--print", "--config", str(config))
    assert refused.exit_code == 1
    assert f"{MODEL} v1 was trained for another target than {cfg.output_path / 'target'}" in refused.output
    assert "hidden_size: checkpoint has 64, target has 32" in refused.output
    assert f"target_revision: checkpoint has '{served['revision']}', target has 'another-revision'" in refused.output
    assert "--speculative-config" not in refused.output

    missing = invoke("serve", "--version", "7", "--print", "--config", str(config))
    assert missing.exit_code == 1 and f"no version 7 of '{MODEL}'" in missing.output
    no_alias = invoke("serve", "--alias", "previous", "--print", "--config", str(config))
    assert no_alias.exit_code == 1 and "has alias 'previous'" in no_alias.output


def test_the_recommended_setting_comes_from_the_tag_or_says_why_not() -> None:
    tree = {"sglang": {"method": "eagle3", "num_speculative_tokens": None, "steps": 3, "topk": 4, "num_draft_tokens": 8}}
    assert recommended_setting(json.dumps(tree), "sglang", 3) == (ServingSetting(3, 4, 8),
                                                                  "eaglet.recommended_serving (sglang: s3-t4-n8)")
    older = {"vllm": {"method": "eagle3", "num_speculative_tokens": 4}}  # before steps/topk were recorded
    assert recommended_setting(json.dumps(older), "vllm", 3)[0] == ServingSetting(4)
    setting, source = recommended_setting(json.dumps(older), "sglang", 3)
    assert setting == ServingSetting(3) and "no sglang entry (measured: vllm)" in source
    setting, source = recommended_setting(None, "vllm", 5)
    assert setting == ServingSetting(5) and source.startswith("the version has no eaglet.recommended_serving tag")


# --- the real vLLM CPU build ----------------------------------------------------------------------------


def test_serve_runs_the_champion_on_vllm_until_interrupted(exported_run: RunConfig, tmp_path: Path,  # noqa: F811
                                                           mlflow_uri: str, vllm_python: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The command itself, as a process: ready line, one chat reply, the drafter drafting, Ctrl-C stops it all."""
    import httpx

    from tasks.serving.engine import _http_get, free_port, parse_prometheus
    from tasks.serving.spec_counters import speculative_window

    monkeypatch.chdir(tmp_path)
    engines = {"vllm": {"python": str(vllm_python), "port": free_port()}}
    _, config = registered(exported_run, tmp_path, mlflow_uri, engines)
    recommend(mlflow_uri, {"vllm": {"method": "eagle3", "num_speculative_tokens": 2, "steps": 2}})

    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--config", str(config),
                                "runtime.engines.vllm.env={VLLM_CPU_KVCACHE_SPACE: '1'}"], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    output: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stdout:  # type: ignore[union-attr]
            output.append(line)
            if line.startswith("ready"):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        while not ready.wait(1) and process.poll() is None and time.monotonic() < deadline:
            pass
        assert ready.is_set() and process.poll() is None, "".join(output)
        ready_s = time.monotonic() - started
        line = next(line for line in output if line.startswith("ready"))
        base_url, model = re.search(r"base URL (\S+)\s+model '([^']+)'", line).groups()  # type: ignore[union-attr]
        assert "k2 from eaglet.recommended_serving" in "".join(output)
        reply = httpx.post(f"{base_url}/chat/completions", timeout=120, json={
            "model": model, "messages": [{"role": "user", "content": "Tell me a story about a quick brown fox."}],
            "temperature": 0, "max_tokens": 12})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"].strip(), "a non-empty reply"
        status, body = _http_get(base_url.removesuffix("/v1") + "/metrics", 10.0)
        window = speculative_window("vllm", {}, parse_prometheus(body.decode()))
        assert status == 200 and window["drafts"] > 0 and window["draft_tokens"] == 2 * window["drafts"], window
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=60)
        reader.join(timeout=10)
    assert code == 0 and "stopped" in "".join(output), "".join(output)
    port = int(re.search(r":(\d+)/v1", base_url).group(1))  # type: ignore[union-attr]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
    print(f"eaglet serve: ready in {ready_s:.1f} s, whole test {time.monotonic() - started:.1f} s")
