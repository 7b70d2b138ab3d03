"""Where MLflow keeps a run's records: sqlite under the output dir (MLflow 3 refuses the file store), with
artifacts beside the database rather than in the current directory."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from contract.config import RunConfig


def tracking_uri(cfg: RunConfig) -> str:
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    database = (cfg.output_path / "mlflow.db").resolve()
    database.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{database}"


def ensure_experiment(uri: str, name: str) -> None:
    """Make `name` the active experiment; a new one keeps its artifacts beside a sqlite store, not in the cwd."""
    import mlflow

    client = mlflow.MlflowClient(uri)
    if client.get_experiment_by_name(name) is None:
        client.create_experiment(name, artifact_location=artifact_root(uri))
    mlflow.set_experiment(name)


def artifact_root(uri: str) -> Optional[str]:
    """`mlartifacts/` beside a sqlite database; None (the server's default) for any other store."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    return (Path(uri[len(prefix):]).parent / "mlartifacts").resolve().as_uri()
