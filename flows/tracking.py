"""MLflow tracking of a pipeline run: the resolved config as params, each stage's numbers and reports.

The default store is sqlite under the run's output dir (MLflow 3 refuses the file store).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from contract.config import RunConfig
from contract.config_loading import config_as_yaml, flatten_config
from flows.stages import StageResult
from tasks.common.mlflow_store import ensure_experiment, tracking_uri


class Tracker:
    """Logs into one active MLflow run; a disabled tracker does nothing."""

    def __init__(self, mlflow_module: Optional[object]) -> None:
        self.mlflow = mlflow_module

    @property
    def run_id(self) -> str | None:
        if self.mlflow is None:
            return None
        return self.mlflow.active_run().info.run_id

    def log_stage(self, name: str, result: StageResult) -> None:
        if self.mlflow is None:
            return
        metrics = {f"{name}.{key}": float(value) for key, value in result.summary().items()}
        self.mlflow.log_metrics(metrics)
        for path in result.reports():
            if Path(path).is_file():
                self.mlflow.log_artifact(str(path), artifact_path=f"reports/{name}")


@contextmanager
def tracked_run(cfg: RunConfig, run_name: str, tags: dict[str, str] | None = None) -> Iterator[Tracker]:
    """An MLflow run holding the resolved config; yields a Tracker (inert when tracking is off)."""
    if not cfg.tracking.enabled:
        yield Tracker(None)
        return
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(cfg))
    ensure_experiment(tracking_uri(cfg), cfg.tracking.experiment)
    with mlflow.start_run(run_name=run_name, tags={"eaglet.run_id": cfg.run_id, **(tags or {})}):
        mlflow.log_params(flatten_config(cfg))
        mlflow.log_text(config_as_yaml(cfg), "config/run.yaml")
        yield Tracker(mlflow)


@contextmanager
def joined_run(cfg: RunConfig, run_id: Optional[str]) -> Iterator[None]:
    """Make the pipeline's MLflow run `run_id` active in this process (a stage placed on another work pool), so what
    the stage logs itself lands where an in-process stage's would. The run stays RUNNING: the pipeline ends it."""
    if not cfg.tracking.enabled or run_id is None:
        yield
        return
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(cfg))
    joined = mlflow.start_run(run_id=run_id)
    mlflow.set_experiment(experiment_id=joined.info.experiment_id)  # where the stage's nested runs go
    try:
        yield
    finally:
        mlflow.end_run(status="RUNNING")


def log_to_pipeline_run(cfg: RunConfig, files: list[Path], artifact_path: str) -> Optional[str]:
    """Attach files made after the flow (the roofline) to the newest pipeline run of this run_id, the one `eaglet run`
    just ended; returns its id, or None when tracking is off or no pipeline run is recorded."""
    if not cfg.tracking.enabled:
        return None
    import mlflow

    client = mlflow.MlflowClient(tracking_uri(cfg))
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    if experiment is None:
        return None
    pipeline_runs = f"tags.`eaglet.run_id` = '{cfg.run_id}' and tags.`eaglet.kind` = 'pipeline'"
    runs = client.search_runs([experiment.experiment_id], filter_string=pipeline_runs, max_results=1,
                              order_by=["attributes.start_time DESC"])
    if not runs:
        return None
    run_id = runs[0].info.run_id
    for path in files:
        client.log_artifact(run_id, str(path), artifact_path)
    return run_id
