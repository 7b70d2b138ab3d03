"""Shared fixtures: a tiny random Llama target, one Prefect test harness, a migrated MLflow store."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Keep eaglet's conversion cache inside the test session."""
    cache = tmp_path_factory.mktemp("eaglet-cache")
    os.environ["EAGLET_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 6-layer Llama (H=64) with a ChatML BPE tokenizer, saved as an HF directory."""
    from tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-target") / "model")


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test harness per session (it costs ~30 s to start)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def mlflow_template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow sqlite store migrated once; tests copy it instead of migrating again."""
    import mlflow

    database = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    mlflow.MlflowClient(tracking_uri=f"sqlite:///{database}").search_experiments()
    return database


@pytest.fixture
def mlflow_uri(tmp_path: Path, mlflow_template_db: Path) -> str:
    database = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template_db, database)
    return f"sqlite:///{database}"
