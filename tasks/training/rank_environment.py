"""What the torchrun ranks get besides `train/launch.yaml`: the secrets they need, through their environment only.

launch.yaml is written like every config eaglet writes, secrets redacted (contract/secrets.py). The ranks need no
engine environment and no API key, but rank 0 logs to MLflow, so the real `tracking.tracking_uri` travels in
EAGLET_TRACKING_URI, set in the ranks' environment alone (not in the launcher's, never in a file). A rank that
started without it and reads a redacted URI fails naming tracking.tracking_uri when it opens MLflow.
"""

from __future__ import annotations

import os

from contract.config import RunConfig

TRACKING_URI_VARIABLE = "EAGLET_TRACKING_URI"
#: The pipeline's MLflow run, under which rank 0 nests its training run (not secret).
PARENT_RUN_VARIABLE = "EAGLET_PARENT_RUN_ID"


def rank_secrets(cfg: RunConfig) -> dict[str, str]:
    """Environment entries for the rank processes the launcher starts."""
    if not cfg.tracking.tracking_uri:
        return {}
    return {TRACKING_URI_VARIABLE: cfg.tracking.tracking_uri}


def with_rank_secrets(cfg: RunConfig) -> RunConfig:
    """A rank's launch config with the secrets its launcher passed in the environment put back."""
    uri = os.environ.get(TRACKING_URI_VARIABLE)
    if not uri:
        return cfg
    return cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"tracking_uri": uri})})
