"""The package versions an engine's python reports key the stages that run it (flows/outside_inputs.py).

The engine's python is a real interpreter: a `python` shim in a temporary "venv" that execs this interpreter with
a site directory holding a `vllm` distribution (its dist-info, as pip installs it), so `importlib.metadata` in
that interpreter reports the version; "upgrading" renames the dist-info, as pip does.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from contract.config import RunConfig
from contract.config_loading import load_config
from flows.stage_cache import results_dir, stage_cache_key
from tasks.serving.engine_versions import engine_versions


def install_fake_vllm(site: Path, version: str) -> None:
    """Replace the site dir's vllm distribution by one of `version` (its METADATA is what pip writes)."""
    for old in site.glob("vllm-*.dist-info"):
        shutil.rmtree(old)
    dist_info = site / f"vllm-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")


@pytest.fixture
def engine_venv(tmp_path: Path, subprocesses: None) -> tuple[Path, Path]:
    """(the shim python, its site directory) with vllm 0.10.0 installed."""
    site = tmp_path / "venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    install_fake_vllm(site, "0.10.0")
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return python, site


def engine_run(tmp_path: Path, python: Path, *overrides: str) -> RunConfig:
    return load_config(None, [f"output_dir={tmp_path / 'out'}", f"runtime.engines.vllm.python={python}", *overrides])


def test_a_stage_that_runs_an_engine_is_rekeyed_when_the_engine_is_upgraded(tmp_path: Path, engine_venv) -> None:
    python, site = engine_venv
    runs = {
        "benchmark": engine_run(tmp_path, python, "benchmark.engines=[vllm]"),
        "capture": engine_run(tmp_path, python, "capture.backend=vllm"),
        "regenerate": engine_run(tmp_path, python, "regeneration.backend=openai", "regeneration.engine=vllm"),
    }
    memo = results_dir(runs["benchmark"]) / "engine-versions.json"
    reported = engine_versions("vllm", runs["benchmark"].runtime.engines["vllm"], memo)
    assert reported["vllm"] == "0.10.0" and reported["transformers"] is not None, "the shim's site dir, then ours"
    before = {name: stage_cache_key(name, cfg) for name, cfg in runs.items()}
    assert {name: stage_cache_key(name, cfg) for name, cfg in runs.items()} == before, "unchanged: the same keys"
    validate_key = stage_cache_key("validate", runs["benchmark"])

    install_fake_vllm(site, "0.11.0")
    after = {name: stage_cache_key(name, cfg) for name, cfg in runs.items()}
    assert all(after[name] != before[name] for name in runs), "each stage that runs vLLM is keyed on its version"
    assert engine_versions("vllm", runs["benchmark"].runtime.engines["vllm"], memo)["vllm"] == "0.11.0"
    assert stage_cache_key("validate", runs["benchmark"]) == validate_key, "a stage without an engine is not"


def test_the_probe_is_remembered_until_the_interpreter_or_its_site_dirs_change(tmp_path: Path, engine_venv) -> None:
    python, site = engine_venv
    engine = engine_run(tmp_path, python).runtime.engines["vllm"]
    memo = tmp_path / "engine-versions.json"
    assert engine_versions("vllm", engine, memo)["vllm"] == "0.10.0"
    # A dist-info edited in place leaves the site dir's mtime alone: the memo answers without running python, so
    # it still says what the probe saw (pip never edits a dist-info in place; it renames it).
    (site / "vllm-0.10.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 9.9\n")
    assert engine_versions("vllm", engine, memo)["vllm"] == "0.10.0", "the memo answered"
    python.write_text(python.read_text() + "# edited\n")
    assert engine_versions("vllm", engine, memo)["vllm"] == "9.9", "another interpreter file: probed again"
    missing = engine.model_copy(update={"python": str(tmp_path / "nowhere" / "python")})
    assert engine_versions("vllm", missing, memo) == {"python": f"missing: {missing.python}"}
