"""`eaglet deploy` against a real Prefect server: the served deployment has its cron and runs to COMPLETED.

The server, the serving process and the flow run are subprocesses with their own PREFECT_HOME and
PREFECT_API_URL, so the session's test harness (conftest.prefect_harness) is neither used nor disturbed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import httpx
import pytest
import yaml

from pipeline_inputs import tiny_run_config, write_conversations
from tasks.serving.engine import free_port

BIN = Path(sys.executable).parent
CRON = "0 3 * * 0"
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float, process: subprocess.Popen | None = None) -> T:
    """Poll `probe` until it returns something; fail naming `what` (and say so if `process` died first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        if process is not None and process.poll() is not None:
            pytest.fail(f"{what}: the process exited with {process.returncode} first")
        time.sleep(0.5)
    pytest.fail(f"{what}: not within {timeout_s:g} s")


def stop(process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGINT to the process group (a clean shutdown), SIGKILL if it is still there after the timeout."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def start(command: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
    with open(log, "ab") as handle:
        return subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)


def healthy(api_url: str) -> bool | None:
    try:
        return True if httpx.get(f"{api_url}/health", timeout=2).status_code == 200 else None
    except httpx.TransportError:
        return None


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`prefect server start` on a free 127.0.0.1 port; yields the environment of a client of that server."""
    tmp_path = tmp_path_factory.mktemp("prefect-server")
    api_url = f"http://127.0.0.1:{free_port()}/api"
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_API_URL=api_url,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    port = api_url.rsplit(":", 1)[1].removesuffix("/api")
    server = start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", port],
                   env, tmp_path / "server.log", tmp_path)
    try:
        wait_for("prefect server health", lambda: healthy(api_url), 180, server)
        yield env
    finally:
        stop(server)
    assert server.returncode is not None


def write_config(tmp_path: Path, tiny_target_dir: Path, deployment: str, tracking: dict | None = None,
                 work_pools: dict[str, str] | None = None) -> Path:
    chats = write_conversations(tmp_path / "inputs" / "chats.jsonl")
    config = tiny_run_config(str(tmp_path / "out"), tiny_target_dir, str(chats), tracking or {"enabled": False})
    config["deployment"]["name"] = deployment
    if work_pools:
        config["deployment"]["work_pools"] = work_pools
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def read_deployment(client, name: str):
    from prefect.exceptions import ObjectNotFound

    try:
        return client.read_deployment_by_name(name)
    except ObjectNotFound:
        return None


def final_state(client, flow_run_id):
    state = client.read_flow_run(flow_run_id).state
    return state if state is not None and state.is_final() else None


def assert_cheap_stages_ran(out: Path) -> None:
    assert (out / "target.json").is_file() and (out / "data" / "prompts.jsonl").is_file()
    assert not (out / "data" / "regenerated.jsonl").exists(), "only the deployment's stages ran"


def test_served_deployment_has_the_cron_and_a_triggered_run_completes(prefect_server: dict[str, str], tmp_path: Path,
                                                                      tiny_target_dir: Path) -> None:
    from prefect.client.orchestration import SyncPrefectClient

    config = write_config(tmp_path, tiny_target_dir, "eaglet-test")
    command = [str(BIN / "eaglet"), "deploy", "--config", str(config), "--cron", CRON, "--stages", "ingest,target"]
    serving = start(command, prefect_server, tmp_path / "serve.log", tmp_path)
    try:
        with SyncPrefectClient(prefect_server["PREFECT_API_URL"]) as client:
            deployment = wait_for("deployment", lambda: read_deployment(client, "eaglet-pipeline/eaglet-test"), 120, serving)
            assert [item.schedule.cron for item in deployment.schedules] == [CRON]
            assert deployment.parameters == {"config_path": str(config.resolve()), "overrides": [],
                                             "stages": ["target", "ingest"]}
            flow_run = client.create_flow_run_from_deployment(deployment.id)
            state = wait_for("flow run", lambda: final_state(client, flow_run.id), 180, serving)
        assert state.type.value == "COMPLETED", (state, (tmp_path / "serve.log").read_text()[-3000:])
        assert_cheap_stages_ran(tmp_path / "out")
    finally:
        stop(serving)
    assert serving.returncode is not None


def test_work_pool_deployment_runs_on_a_worker(prefect_server: dict[str, str], tmp_path: Path, tiny_target_dir: Path) -> None:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import WorkPoolCreate

    config = write_config(tmp_path, tiny_target_dir, "eaglet-pooled")
    with SyncPrefectClient(prefect_server["PREFECT_API_URL"]) as client:
        client.create_work_pool(WorkPoolCreate(name="eaglet-test-pool", type="process"))
        command = [str(BIN / "eaglet"), "deploy", "--config", str(config), "--cron", CRON, "--stages", "target,ingest",
                   "--work-pool", "eaglet-test-pool"]
        registered = subprocess.run(command, env=prefect_server, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert registered.returncode == 0, registered.stdout + registered.stderr
        deployment = client.read_deployment_by_name("eaglet-pipeline/eaglet-pooled")
        assert deployment.work_pool_name == "eaglet-test-pool" and deployment.entrypoint == "flows.pipeline.pipeline"
        assert [item.schedule.cron for item in deployment.schedules] == [CRON]
        flow_run = client.create_flow_run_from_deployment(deployment.id)
        worker = [str(BIN / "prefect"), "worker", "start", "--pool", "eaglet-test-pool", "--run-once"]
        subprocess.run(worker, env=prefect_server, cwd=tmp_path, capture_output=True, timeout=300, check=True)
        state = client.read_flow_run(flow_run.id).state
    assert state.type.value == "COMPLETED", state
    assert_cheap_stages_ran(tmp_path / "out")


#: The placed run: the pipeline flow on a "cpu" pool, the stages a GPU host would run on a "gpu" pool.
PLACED_STAGES = "target,ingest,regenerate,validate,capture,train"
GPU_STAGES = ("regenerate", "capture", "train")


def stage_flow_runs(client) -> list:
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["eaglet-stage"])))


def test_placed_stages_run_on_their_work_pool_and_hand_results_through_the_output_dir(
        prefect_server: dict[str, str], tmp_path: Path, tiny_target_dir: Path, mlflow_uri: str) -> None:
    """Two process work pools, one worker each: the pipeline flow runs on `cpu`, regenerate/capture/train run as
    `eaglet-stage` subflow runs on `gpu`, in the gpu worker's processes, logging into the pipeline's MLflow run."""
    import mlflow
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import WorkPoolCreate

    tracking = {"tracking_uri": mlflow_uri, "experiment": "placed"}
    config = write_config(tmp_path, tiny_target_dir, "eaglet-placed", tracking, {name: "gpu" for name in GPU_STAGES})
    worker_env = {**prefect_server, "PREFECT_WORKER_QUERY_SECONDS": "1"}
    workers = []
    with SyncPrefectClient(prefect_server["PREFECT_API_URL"]) as client:
        for pool in ("cpu", "gpu"):
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        command = [str(BIN / "eaglet"), "deploy", "--config", str(config), "--cron", CRON, "--stages", PLACED_STAGES,
                   "--work-pool", "cpu"]
        registered = subprocess.run(command, env=prefect_server, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert registered.returncode == 0, registered.stdout + registered.stderr
        printed = " ".join(registered.stdout.split())
        assert "eaglet-stage/eaglet-placed-gpu" in printed and "stages regenerate, capture, train" in printed, printed
        pipeline_deployment = client.read_deployment_by_name("eaglet-pipeline/eaglet-placed")
        assert pipeline_deployment.parameters["place_stages"] is True and pipeline_deployment.work_pool_name == "cpu"
        stage_deployment = client.read_deployment_by_name("eaglet-stage/eaglet-placed-gpu")
        assert stage_deployment.work_pool_name == "gpu" and stage_deployment.entrypoint == "flows.pipeline.placed_stage"
        assert not stage_deployment.schedules, "the pipeline's runs start the stage deployment, no schedule of its own"
        try:
            for pool in ("cpu", "gpu"):
                workers.append(start([str(BIN / "prefect"), "worker", "start", "--pool", pool], worker_env,
                                     tmp_path / f"worker-{pool}.log", tmp_path))
            flow_run = client.create_flow_run_from_deployment(pipeline_deployment.id)
            state = wait_for("placed pipeline run", lambda: final_state(client, flow_run.id), 900)
            logs = "".join((tmp_path / f"worker-{pool}.log").read_text()[-3000:] for pool in ("cpu", "gpu"))
            assert state.type.value == "COMPLETED", (state, logs)
            parent = client.read_flow_run(flow_run.id)
            placed = stage_flow_runs(client)
            parent_links = {client.read_task_run(run.parent_task_run_id).flow_run_id for run in placed}
        finally:
            for worker in workers:
                stop(worker)
    assert parent.work_pool_name == "cpu"
    assert sorted((run.parameters["stage"], run.work_pool_name, run.state.type.value) for run in placed) == [
        (name, "gpu", "COMPLETED") for name in sorted(GPU_STAGES)]
    assert parent_links == {flow_run.id}, "each placed stage is a subflow run of the pipeline's run"
    out = tmp_path / "out"
    assert (out / "features" / "manifest.json").is_file() and (out / "draft" / "sglang" / "model.safetensors").is_file()

    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("placed")
    (run,) = client.search_runs([experiment.experiment_id], "tags.\"eaglet.kind\" = 'pipeline'")
    assert run.info.status == "FINISHED"
    assert run.data.metrics["train.complete"] == 1 and run.data.metrics["capture.ok"] >= 1, \
        "the pipeline read the placed stages' records from output_dir"
    (training,) = client.search_runs([experiment.experiment_id], "tags.\"eaglet.stage\" = 'train'")
    assert training.data.tags["mlflow.parentRunId"] == run.info.run_id, "the gpu worker's trainer joined the run"
