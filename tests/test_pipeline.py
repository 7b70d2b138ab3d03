"""The Prefect flow (caching, retries, failures) and the `eaglet stage` command, tracked in a real MLflow store."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlflow
import yaml
from prefect.client.schemas.objects import TaskRun
from prefect.states import State
from typer.testing import CliRunner

from contract.config_loading import load_config
from flows.cli import app
from flows.pipeline import is_transient, pipeline
from flows.stage_cache import REPO_ROOT, stage_cache_key, stage_spec
from flows.stages import STAGE_ORDER
from pipeline_inputs import tiny_run_config, write_conversations
from tasks.serving.engine import EngineMissing, EngineStartError, free_port


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
    assert list(summaries) == list(STAGE_ORDER)
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

    cached = pipeline(str(config), ["validation.max_length=512"], return_state=True)
    assert set(state_names(cached).values()) == {"Cached"}
    assert cached.result() == summaries, "every stage's result round-trips through the persisted results"


CHEAP_STAGES = ["target", "ingest", "regenerate", "validate"]

#: Stands in for vLLM's server module: the first launch dies (as an engine does when its port or GPU memory
#: is not yet free); later launches serve the target with tests/openai_server.py.
FLAKY_ENGINE = """\
import os, sys, time
from pathlib import Path

args = sys.argv[1:]
marker = Path(os.environ["FLAKY_ENGINE_MARKER"])
if not marker.exists():
    marker.write_text("failed once")
    print("flaky engine: the first launch never gets ready", flush=True)
    time.sleep(600)
sys.path.insert(0, os.environ["FLAKY_ENGINE_TESTS"])
import openai_server
sys.argv = ["openai_server", *(part for name in ("--model", "--port", "--served-model-name")
                               for part in (name, args[args.index(name) + 1]))]
openai_server.main()
"""


def untracked_config(tmp_path: Path, tiny_target_dir: Path, **sections: dict) -> Path:
    """The tiny run without MLflow (these tests look at Prefect's side only)."""
    chats = write_conversations(tmp_path / "inputs" / "chats.jsonl")
    config = tiny_run_config(str(tmp_path / "out"), tiny_target_dir, str(chats), {"enabled": False})
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def task_runs(flow_state: State) -> dict[str, TaskRun]:
    """The task runs of a finished flow run, by stage name."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=flow_runs)
    return {run.name.rsplit("-", 1)[0]: run for run in runs}


def state_names(flow_state: State) -> dict[str, str]:
    return {name: run.state.name for name, run in task_runs(flow_state).items()}


def mtimes(out: Path, names: list[str]) -> dict[str, int]:
    return {name: (out / name).stat().st_mtime_ns for name in names}


def test_unchanged_stages_are_cached_and_changed_ones_rerun(prefect_harness, tmp_path: Path, tiny_target_dir: Path) -> None:
    config, out = str(untracked_config(tmp_path, tiny_target_dir)), tmp_path / "out"
    outputs = ["target.json", "data/prompts.jsonl", "data/regenerated.jsonl", "data/train.jsonl"]
    first = pipeline(config, [], CHEAP_STAGES, return_state=True)
    assert state_names(first) == dict.fromkeys(CHEAP_STAGES, "Completed")
    written = mtimes(out, outputs)

    again = pipeline(config, [], CHEAP_STAGES, return_state=True)
    assert state_names(again) == dict.fromkeys(CHEAP_STAGES, "Cached")
    assert mtimes(out, outputs) == written, "a cached stage writes nothing"
    assert again.result() == first.result(), "stage results round-trip through the persisted results"
    assert any((out / ".prefect-results").iterdir())

    changed = pipeline(config, ["validation.eval_fraction=0.5"], CHEAP_STAGES, return_state=True)
    assert state_names(changed) == {"target": "Cached", "ingest": "Cached", "regenerate": "Cached", "validate": "Completed"}

    (out / "data" / "prompts.jsonl").unlink()
    rebuilt = pipeline(config, ["validation.eval_fraction=0.5"], CHEAP_STAGES, return_state=True)
    assert state_names(rebuilt) == {"target": "Cached", "ingest": "Completed", "regenerate": "Cached", "validate": "Cached"}, \
        "a missing output reruns its stage; the same content downstream is still a hit"

    forced = pipeline(config, [], ["ingest"], use_cache=False, return_state=True)
    assert state_names(forced) == {"ingest": "Completed"}

    chats = tmp_path / "inputs" / "chats.jsonl"
    chats.write_text(chats.read_text() + json.dumps({"id": "c4", "messages": [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}) + "\n")
    edited = pipeline(config, ["validation.eval_fraction=0.5"], CHEAP_STAGES, return_state=True)
    assert state_names(edited) == {"target": "Cached", "ingest": "Completed", "regenerate": "Completed",
                                   "validate": "Completed"}, "an edited source file reruns ingest and what follows"
    assert edited.result()["ingest"]["ok"] == first.result()["ingest"]["ok"] + 1


def test_dvc_yaml_params_are_the_stages_declared_reads() -> None:
    """dvc.yaml's `params` mirror flows/stages.py STAGE_READS, and params.yaml spells out each of them (DVC
    refuses a stage whose param is missing from the params file)."""
    from flows.dvc_sync import SYNC_COMMAND
    from flows.stages import STAGE_READS

    params_file = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    for name in STAGE_ORDER:
        declared = STAGE_READS[name].params
        assert stage_spec(name).params == declared, f"dvc.yaml stage {name} must list its declared reads: run `{SYNC_COMMAND}`"
        for param in declared:
            node = params_file
            for part in param.split("."):
                assert isinstance(node, dict) and part in node, f"params.yaml lacks {param} (read by {name})"
                node = node[part]


def test_a_failing_stage_is_named_not_retried_and_earlier_artifacts_stay(prefect_harness, tmp_path: Path,
                                                                         tiny_target_dir: Path) -> None:
    broken_contract = {"max_length": 8, "expectation_thresholds": {"supervised_tokens_after_truncation": 0.0}}
    config = untracked_config(tmp_path, tiny_target_dir, validation=broken_contract)
    state = pipeline(str(config), [], CHEAP_STAGES, return_state=True)
    assert state.is_failed()
    assert "stage validate failed: DataContractError" in state.message
    runs = task_runs(state)
    assert runs["validate"].state.is_failed() and runs["validate"].run_count == 1, "a deterministic failure is not retried"
    for kept in ("target.json", "data/prompts.jsonl", "data/regenerated.jsonl"):
        assert (tmp_path / "out" / kept).is_file(), f"{kept} of an earlier stage was kept"


def test_every_stage_is_keyed_by_what_dvc_yaml_says_it_reads(tmp_path: Path) -> None:
    cfg = load_config(None, [f"output_dir={tmp_path}"])
    for name in STAGE_ORDER:
        assert stage_spec(name).outputs, f"dvc.yaml declares no outputs for {name}"
        assert stage_cache_key(name, cfg) == stage_cache_key(name, cfg), "the key is deterministic"
    key = stage_cache_key("validate", cfg)
    assert stage_cache_key("validate", load_config(None, [f"output_dir={tmp_path}", "training.learning_rate=0.5"])) == key
    assert stage_cache_key("validate", load_config(None, [f"output_dir={tmp_path}", "validation.seed=7"])) != key
    regenerated = tmp_path / "data" / "regenerated.jsonl"
    regenerated.parent.mkdir(parents=True)
    regenerated.write_text("{}\n")
    assert stage_cache_key("validate", cfg) != key, "a dep under ${output_dir} is hashed by content"


def flaky_engine(tmp_path: Path) -> dict:
    """runtime.engines.vllm that starts FLAKY_ENGINE through the real vLLM command line."""
    package = tmp_path / "flaky" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for directory in (package.parent.parent, package.parent, package):
        (directory / "__init__.py").write_text("")
    (package / "api_server.py").write_text(FLAKY_ENGINE)
    env = {"PYTHONPATH": str(tmp_path / "flaky"), "FLAKY_ENGINE_MARKER": str(tmp_path / "failed-once"),
           "FLAKY_ENGINE_TESTS": str(Path(__file__).parent)}
    return {"vllm": {"python": sys.executable, "port": free_port(), "env": env, "startup_timeout_s": 30}}


def test_an_engine_that_was_not_ready_in_time_is_retried(prefect_harness, tmp_path: Path,
                                                         tiny_target_dir: Path) -> None:
    config = untracked_config(tmp_path, tiny_target_dir, runtime={"engines": flaky_engine(tmp_path)},
                              regeneration={"backend": "openai", "engine": "vllm", "concurrency": 2})
    state = pipeline(str(config), [], ["target", "ingest", "regenerate"], return_state=True)
    assert state.is_completed(), state.message
    assert task_runs(state)["regenerate"].run_count == 2, "EngineNotReady on the first try, served on the second"
    assert state.result()["regenerate"]["ok"] == 5
    log = (tmp_path / "out" / "logs" / "regenerate-vllm.log").read_text()
    assert "the first launch never gets ready" in log and log.count("starting:") == 2


def test_an_engine_that_exits_at_start_up_fails_the_stage_at_once(prefect_harness, tmp_path: Path,
                                                                  tiny_target_dir: Path) -> None:
    engines = flaky_engine(tmp_path)
    engines["vllm"]["extra_args"] = ["--no-such-flag"]
    (tmp_path / "flaky" / "vllm" / "entrypoints" / "openai" / "api_server.py").write_text(
        "import sys\nprint('api_server: error: unrecognized arguments: --no-such-flag', flush=True)\nsys.exit(2)\n")
    config = untracked_config(tmp_path, tiny_target_dir, runtime={"engines": engines},
                              regeneration={"backend": "openai", "engine": "vllm"})
    state = pipeline(str(config), [], ["target", "ingest", "regenerate"], return_state=True)
    assert state.is_failed()
    assert "stage regenerate failed: EngineExited" in state.message and "--no-such-flag" in state.message
    assert task_runs(state)["regenerate"].run_count == 1, "the same command would exit again: not retried"


def test_an_engine_whose_python_is_missing_fails_at_once(prefect_harness, tmp_path: Path, tiny_target_dir: Path) -> None:
    assert not is_transient(EngineMissing("no python")) and is_transient(EngineStartError("exited with 1"))
    missing = tmp_path / "no-venv" / "bin" / "python"
    config = untracked_config(tmp_path, tiny_target_dir, runtime={"engines": {"vllm": {"python": str(missing)}}},
                              regeneration={"backend": "openai", "engine": "vllm"})
    state = pipeline(str(config), [], ["target", "ingest", "regenerate"], return_state=True)
    assert state.is_failed()
    assert "stage regenerate failed: EngineMissing" in state.message and str(missing) in state.message
    assert task_runs(state)["regenerate"].run_count == 1, "a missing environment is not retried"


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


class Planted:
    """What an attacker with write access to the output directory would plant: unpickling runs a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_planted_pickle_result_is_never_loaded(prefect_harness, tmp_path: Path, tiny_target_dir: Path) -> None:
    """Stage results are persisted as plain JSON; a record of another serializer is set aside, not read."""
    import base64
    import pickle

    config, out = str(untracked_config(tmp_path, tiny_target_dir)), tmp_path / "out"
    pipeline(config, [], ["target", "ingest"], return_state=True)
    record_path = out / ".prefect-results" / stage_cache_key("ingest", load_config(config, []))
    record = json.loads(record_path.read_bytes())
    assert record["metadata"]["serializer"]["type"] == "json"
    assert json.loads(record["result"])["summary"]["ok"] == 6, "the record holds the summary as plain JSON"

    marker = tmp_path / "planted-code-ran"
    record["metadata"]["serializer"] = {"type": "pickle", "picklelib": "cloudpickle", "picklelib_version": None}
    record["result"] = base64.encodebytes(pickle.dumps(Planted(marker))).decode()
    record_path.write_text(json.dumps(record))
    again = pipeline(config, [], ["target", "ingest"], return_state=True)
    assert again.is_completed()
    assert not marker.exists(), "the planted pickle was unpickled"
    assert state_names(again) == {"target": "Cached", "ingest": "Completed"}, "the refused record is a cache miss"
    assert record_path.with_name(record_path.name + ".refused").is_file()
    assert json.loads(record_path.read_bytes())["metadata"]["serializer"]["type"] == "json", "rewritten as JSON"
