"""The Prefect flow and the `eaglet stage` command over target + ingest, tracked in a real MLflow store."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import yaml
from typer.testing import CliRunner

from flows.cli import app
from flows.pipeline import pipeline
from pipeline_inputs import tiny_run_config, write_conversations


def write_config(tmp_path: Path, tiny_target_dir: Path, mlflow_uri: str) -> Path:
    chats = write_conversations(tmp_path / "inputs" / "chats.jsonl")
    config = tiny_run_config(str(tmp_path / "out"), tiny_target_dir, str(chats),
                             {"tracking_uri": mlflow_uri, "experiment": "flow-test"})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_prefect_flow_runs_the_stages_and_tracks_them(prefect_harness, tmp_path: Path, tiny_target_dir: Path, mlflow_uri: str) -> None:
    config = write_config(tmp_path, tiny_target_dir, mlflow_uri)
    state = pipeline(str(config), ["validation.max_length=512"], return_state=True)
    assert state.is_completed(), state
    summaries = state.result()
    assert list(summaries) == ["target", "ingest", "regenerate", "validate", "capture", "train", "evaluate", "benchmark"]
    assert summaries["train"]["complete"] == 1 and summaries["train"]["steps"] >= 1 and (tmp_path / "out" / "draft" / "sglang" / "model.safetensors").is_file()
    assert summaries["ingest"] == {"input": 84, "ok": 6, "error": 1, "skipped": 77}
    regenerated = summaries["regenerate"]
    assert (regenerated["input"], regenerated["ok"], regenerated["skipped"]) == (6, 5, 1), "pre-templated text is skipped"
    assert summaries["validate"]["input"] == 5 and summaries["validate"]["train"] + summaries["validate"]["eval"] == 5
    manifest = json.loads((tmp_path / "out" / "features" / "manifest.json").read_text())
    assert manifest["aux_layer_ids"] == [1, 2, 3] and manifest["draft_vocab_size"] == 128
    report = json.loads((tmp_path / "out" / "data" / "ingest_report.json").read_text())
    assert report["ok"] + report["error"] + report["skipped"] == report["input"] == 84
    assert (tmp_path / "out" / "target" / "model.safetensors").is_file()

    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("flow-test")
    (run,) = client.search_runs([experiment.experiment_id], "tags.\"eaglet.kind\" = 'pipeline'")
    (training,) = client.search_runs([experiment.experiment_id], "tags.\"eaglet.stage\" = 'train'")
    assert training.data.tags["mlflow.parentRunId"] == run.info.run_id
    assert "train.loss" in training.data.metrics and "eval.simulated_accept_len" in training.data.metrics
    assert run.info.status == "FINISHED"
    assert run.data.params["validation.max_length"] == "512"
    assert run.data.params["model.source"] == "local"
    assert run.data.metrics["ingest.ok"] == 6 and run.data.metrics["target.num_hidden_layers"] == 6
    artifacts = {item.path for item in client.list_artifacts(run.info.run_id, "reports/ingest")}
    assert "reports/ingest/ingest_report.json" in artifacts
    contract = {item.path for item in client.list_artifacts(run.info.run_id, "reports/validate")}
    assert "reports/validate/data_contract.json" in contract
    assert run.data.metrics["regenerate.tokens_per_second"] > 0
    assert yaml.safe_load(mlflow.artifacts.load_text(f"{run.info.artifact_uri}/config/run.yaml"))["run_id"] == "tiny"


def test_flow_failure_names_the_stage(prefect_harness, tmp_path: Path, tiny_target_dir: Path, mlflow_uri: str) -> None:
    config = write_config(tmp_path, tiny_target_dir, mlflow_uri)
    state = pipeline(str(config), ["data.sources=[{name: gone, path: /nonexistent/chats.jsonl}]"], return_state=True)
    assert state.is_failed()
    assert (tmp_path / "out" / "target.json").is_file(), "the stage before the failure keeps its artifacts"


def test_stage_command_runs_one_stage_and_tracks_it(tmp_path: Path, tiny_target_dir: Path, mlflow_uri: str) -> None:
    config = write_config(tmp_path, tiny_target_dir, mlflow_uri)
    result = CliRunner().invoke(app, ["stage", "ingest", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "data" / "prompts.jsonl").is_file()
    assert not (tmp_path / "out" / "target").exists(), "only the named stage ran"
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("flow-test").experiment_id])
    assert run.data.tags["eaglet.stage"] == "ingest" and run.data.metrics["ingest.error"] == 1
    unknown = CliRunner().invoke(app, ["stage", "trian", "--config", str(config)])
    assert unknown.exit_code == 2 and "unknown stage 'trian'" in unknown.output
