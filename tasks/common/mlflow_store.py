"""Where MLflow keeps a run's records: sqlite under the output dir (MLflow 3 refuses the file store), with
artifacts beside the database rather than in the current directory, or the server `tracking.tracking_uri` names.

A `user:password@` in that URI is a secret (contract/secrets.py) and never reaches MLflow inside the URI: MLflow
prints the URI it is given ("View run at ...") and puts it in its error messages. MLflow's own way to take
credentials is its environment variables (mlflow.utils.credentials), so they go there and the URI without them
goes to MLflow; a child process (a torchrun rank) inherits them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from contract.config import RunConfig
from contract.secrets import unredacted_url

#: MLflow reads HTTP basic auth (both set) or a bearer token from these.
USERNAME_VARIABLE = "MLFLOW_TRACKING_USERNAME"
PASSWORD_VARIABLE = "MLFLOW_TRACKING_PASSWORD"
TOKEN_VARIABLE = "MLFLOW_TRACKING_TOKEN"


def tracking_uri(cfg: RunConfig) -> str:
    """The URI to give MLflow (without userinfo; credentials handed over by `hand_credentials_to_mlflow`)."""
    if cfg.tracking.tracking_uri:
        return hand_credentials_to_mlflow(cfg.tracking.tracking_uri, "tracking.tracking_uri")
    database = (cfg.output_path / "mlflow.db").resolve()
    database.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{database}"


def hand_credentials_to_mlflow(uri: str, field_name: str) -> str:
    """`uri` without its userinfo; `user:password` goes to MLflow's basic-auth variables, a lone `token@` to its
    bearer-token variable. A redacted userinfo (`***`) is refused, naming `field_name`."""
    credentials = unredacted_url(uri, field_name)
    if credentials.password is not None:
        os.environ[USERNAME_VARIABLE] = credentials.username or ""
        os.environ[PASSWORD_VARIABLE] = credentials.password
    elif credentials.username is not None:
        os.environ[TOKEN_VARIABLE] = credentials.username
    return credentials.url


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
