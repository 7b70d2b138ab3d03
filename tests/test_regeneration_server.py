"""The regeneration server's identity (tasks/data/served_model.py) and its port (contract/config.py).

A server at regeneration.base_url must serve the run's target under the name the config expects; what it serves
(name, weights, context) keys the regenerate journal and the stage's cache, so another model behind the same URL
neither extends nor reuses the old replies. Its port must not be one the stages start an engine on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from contract.config_loading import ConfigError, load_config
from flows.cli import app
from flows.stage_cache import stage_cache_key
from tasks import regenerate
from tasks.data.served_model import ServedModelMismatch
from tasks.serving.engine import free_port
from test_regenerate import by_id, openai_run, serve_tiny  # noqa: F401  (serve_tiny: the servers' fixture)

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def other_weights(tmp_path: Path, tiny_target_dir: Path) -> Path:
    """The tiny target's files in another directory: another model as a server reports it (its card's root)."""
    copy = tmp_path / "other-weights"
    shutil.copytree(tiny_target_dir, copy)
    return copy


def user_items(prompts: list[str]) -> list[dict]:
    return [{"id": f"q{n}", "messages": [{"role": "user", "content": prompt}]} for n, prompt in enumerate(prompts)]


def script(path: Path, replies: dict[str, dict]) -> str:
    path.write_text(json.dumps(replies))
    return str(path)


def test_a_server_of_another_model_is_refused_before_any_request(tmp_path: Path, tiny_target_dir: Path,
                                                                  serve_tiny) -> None:
    server = serve_tiny("--served-model-name", "some-other-model")
    cfg = openai_run(tmp_path / "run", tiny_target_dir, server.url)
    with pytest.raises(ServedModelMismatch) as raised:
        regenerate.run(cfg)
    message = str(raised.value)
    assert f"{server.url} serves the model 'some-other-model'" in message
    assert f"this run expects '{tiny_target_dir}' (model.path)" in message
    assert "regeneration.served_model_name: some-other-model" in message, "it says how to accept the name"
    assert server.chat_requests() == 0, "refused before any reply was written"

    named = cfg.model_copy(update={"regeneration": cfg.regeneration.model_copy(
        update={"served_model_name": "some-other-model"})})
    assert regenerate.run(named).report.ok == 2, "the configured served name is accepted"


def test_a_journal_another_model_wrote_is_not_extended_even_under_the_same_name(
        tmp_path: Path, tiny_target_dir: Path, other_weights: Path, serve_tiny) -> None:
    prompts = [f"Question {n}?" for n in range(12)]
    refusing = {prompt: {"content": f"A answers {n}."} if n < 2 else {"status": 404, "message": "no"}
                for n, prompt in enumerate(prompts)}
    port = free_port()
    first = serve_tiny("--served-model-name", "shared-name",
                        "--scripted", script(tmp_path / "a.json", refusing), port=port)
    cfg = openai_run(tmp_path / "run", tiny_target_dir, first.url, user_items(prompts), concurrency=1,
                     chunk_records=1, served_model_name="shared-name")
    with pytest.raises(regenerate.ServerRefusedError):
        regenerate.run(cfg)
    journal = cfg.output_path / "data" / "regenerate.journal.jsonl"
    lines = [json.loads(line) for line in journal.read_text().splitlines()[1:]]
    assert lines[0]["server"]["root"] == str(tiny_target_dir), "the server is named before its entries"
    assert [line["key"] for line in lines[1:]] == ["prompts.jsonl:1", "prompts.jsonl:2"]
    first.stop()

    answering = {prompt: {"content": f"B answers {n}."} for n, prompt in enumerate(prompts)}
    second = serve_tiny("--served-model-name", "shared-name", "--scripted", script(tmp_path / "b.json", answering),
                        port=port, model_dir=other_weights)
    resumed = regenerate.run(cfg)
    assert second.chat_requests() == 12, "every record asked again: the journal of another model is not extended"
    assert (resumed.report.ok, resumed.report.error) == (12, 0)
    contents = [record.messages[-1].content for record in by_id(resumed.output_path).values()]
    assert contents == [f"B answers {n}." for n in range(12)], "no reply of the first model is kept"


def test_the_regenerate_key_follows_the_served_model_and_survives_a_stopped_server(
        tmp_path: Path, tiny_target_dir: Path, other_weights: Path, serve_tiny) -> None:
    port = free_port()
    first = serve_tiny("--served-model-name", "shared-name", port=port)
    cfg = load_config(None, [f"output_dir={tmp_path / 'out'}", "regeneration.backend=openai",
                             f"regeneration.base_url={first.url}", "regeneration.served_model_name=shared-name"])
    served_first = stage_cache_key("regenerate", cfg)
    first.stop()
    assert stage_cache_key("regenerate", cfg) == served_first, "stopped after regeneration: the stage is reused"

    serve_tiny("--served-model-name", "shared-name", port=port, model_dir=other_weights)
    assert stage_cache_key("regenerate", cfg) != served_first, "another model behind the same URL and name: rerun"


def test_a_regeneration_server_on_an_engine_port_is_refused_naming_both_fields() -> None:
    served = ["regeneration.backend=openai"]
    with pytest.raises(ConfigError) as raised:
        load_config(None, [*served, "regeneration.base_url=http://127.0.0.1:30000/v1"])
    assert "regeneration.base_url points at port 30000 on this host" in str(raised.value)
    assert "runtime.engines.sglang.port" in str(raised.value)
    with pytest.raises(ConfigError, match=r"regeneration\.base_url\[1\] points at port 8100 .*runtime\.engines\.vllm"):
        load_config(None, [*served, "regeneration.base_url=[http://10.0.0.7:8100/v1,http://localhost:8100/v1]"])
    assert load_config(None, [*served, "regeneration.base_url=http://gpu-node-3:30000/v1"]), "another host's port"
    assert load_config(None, [*served, "regeneration.base_url=http://127.0.0.1:30000/v1",
                              "runtime.engines.sglang.port=30001"]), "the engine moved"
    assert load_config(None, ["regeneration.base_url=http://127.0.0.1:30000/v1"]), "the local backend asks no server"


def test_the_sglang_recipe_serves_regeneration_apart_from_its_engines(tmp_path: Path) -> None:
    recipe = REPO_ROOT / "configs" / "llama31-8b-sglang.yaml"
    cfg = load_config(recipe)
    ports = {engine.port for engine in cfg.runtime.engines.values()}
    assert cfg.regeneration.base_url == "http://127.0.0.1:30010/v1" and 30010 not in ports
    colliding = CliRunner().invoke(app, ["config", "validate", "--schema-only", "--config", str(recipe),
                                         "regeneration.base_url=http://127.0.0.1:30000/v1"])
    assert colliding.exit_code != 0
    assert "regeneration.base_url" in colliding.output and "runtime.engines.sglang.port" in colliding.output
