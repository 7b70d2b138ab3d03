"""dvc.yaml as shipped, in a temporary git repository: `dvc repro` of every stage on the tiny run, what a
changed param reruns, `dvc exp run -S`, and a local remote's push/pull round trip."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline_inputs import tiny_run_config, write_conversations

REPO_ROOT = Path(__file__).resolve().parent.parent


#: What a stage runs: the packages its code deps live in (tasks/common/stage_code.py) and the CLI dvc.yaml's cmds call.
CODE_DIRECTORIES = ("contract", "models", "tasks", "expectations", "flows")


def run(command: list[str], cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    completed = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, f"{' '.join(command)}\n{completed.stdout}\n{completed.stderr}"
    return completed.stdout + completed.stderr


def dvc(*arguments: str, cwd: Path) -> str:
    return run([sys.executable, "-m", "dvc", *arguments], cwd)


@pytest.mark.integration
def test_dvc_repro_runs_the_stages(tmp_path: Path, tiny_target_dir: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    run(["git", "init", "-q"], repo)
    dvc("init", "-q", cwd=repo)
    dvc("config", "core.analytics", "false", cwd=repo)
    shutil.copy(REPO_ROOT / "dvc.yaml", repo / "dvc.yaml")
    for directory in CODE_DIRECTORIES:  # every code dep, with the package __init__ files it is imported through
        shutil.copytree(REPO_ROOT / directory, repo / directory, ignore=shutil.ignore_patterns("__pycache__"))
    write_conversations(repo / "inputs" / "chats.jsonl")
    params = tiny_run_config("artifacts/tiny", tiny_target_dir, "inputs/chats.jsonl", {"enabled": False})
    write_params(repo, params)

    dvc("repro", cwd=repo)
    report = json.loads((repo / "artifacts/tiny/data/ingest_report.json").read_text())
    assert (report["input"], report["ok"], report["error"]) == (84, 6, 1)
    assert (repo / "artifacts/tiny/target/model.safetensors").is_file()
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"target", "sources", "ingest", "regenerate", "validate", "capture", "train", "evaluate",
                                   "benchmark", "register"}
    assert (repo / "artifacts/tiny/draft/vllm/config.json").is_file()
    assert (repo / "artifacts/tiny/features/manifest.json").is_file()
    contract = json.loads((repo / "artifacts/tiny/reports/data_contract.json").read_text())
    regenerated = (repo / "artifacts/tiny/data/regenerated.jsonl").read_text().splitlines()
    split = [(repo / f"artifacts/tiny/data/{name}.jsonl").read_text().splitlines() for name in ("train", "eval")]
    assert len(split[0]) + len(split[1]) == len(regenerated) > 0
    assert (repo / "artifacts/tiny/reports/data_docs/index.html").is_file()
    assert contract["passed"] and contract["totals"]["input"] == len(regenerated)
    assert "data_contract.json" in dvc("metrics", "show", cwd=repo)
    assert lock["stages"]["target"]["params"]["params.yaml"]["model"]["source"] == "local"

    unchanged = [line for line in dvc("status", cwd=repo).splitlines() if "changed" in line and "always changed" not in line]
    assert unchanged == [], "only the sources stage (always run, cheap) reports itself"
    second = dvc("repro", cwd=repo)
    assert "didn't change" in second or "skipping" in second.lower()

    params["validation"]["eval_fraction"] = 0.5
    write_params(repo, params)
    status = dvc("status", cwd=repo)
    assert "validate" in status and "regenerate" not in status and "ingest" not in status, status

    params["data"]["sources"][1]["limit"] = 5
    params["training"]["resume_from"] = "none"  # other data: start over (the default, auto, refuses other math)
    write_params(repo, params)
    status = dvc("status", cwd=repo)
    assert "ingest" in status and "target" not in status, status
    dvc("repro", cwd=repo)
    report = json.loads((repo / "artifacts/tiny/data/ingest_report.json").read_text())
    assert report["ok"] == 8
    regenerated = (repo / "artifacts/tiny/data/regenerate_report.json").read_text()
    assert json.loads(regenerated)["input"] == 8, "regenerate followed its changed input"

    chats = repo / "inputs" / "chats.jsonl"
    chats.write_text(chats.read_text() + json.dumps({"id": "c4", "messages": [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}) + "\n")
    edited = dvc("repro", cwd=repo)
    assert "Running stage 'ingest'" in edited, "an edited source file reruns ingest"
    assert json.loads((repo / "artifacts/tiny/data/ingest_report.json").read_text())["ok"] == 9
    assert json.loads((repo / "artifacts/tiny/data/regenerate_report.json").read_text())["input"] == 9

    commit_all(repo, "tiny run")
    dvc("exp", "run", "-S", "training.epochs=2", cwd=repo)  # one batch per epoch on this tiny run
    assert yaml.safe_load((repo / "params.yaml").read_text())["training"]["epochs"] == 2
    summary = json.loads((repo / "artifacts/tiny/train/summary.json").read_text())
    assert summary["steps"] == 2 and summary["complete"], "the experiment retrained with its own params"
    assert dvc("exp", "list", cwd=repo).strip(), "the experiment is recorded"

    pushed = {path: digest(repo / path) for path in ("artifacts/tiny/target/model.safetensors",
                                                     "artifacts/tiny/draft/vllm/model.safetensors",
                                                     "artifacts/tiny/data/train.jsonl")}
    dvc("remote", "add", "-d", "local", str(tmp_path / "remote"), cwd=repo)
    dvc("push", cwd=repo)
    shutil.rmtree(repo / ".dvc" / "cache")
    for directory in ("target", "draft", "data"):
        shutil.rmtree(repo / "artifacts" / "tiny" / directory)
    dvc("pull", cwd=repo)
    assert {path: digest(repo / path) for path in pushed} == pushed


def test_dvc_outs_hold_run_artifacts_only() -> None:
    """Engine venvs, pip and HF caches never become DVC outs: every out lives under the run's output dir."""
    stages = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        for out in stage.get("outs", []):
            path = next(iter(out)) if isinstance(out, dict) else out
            assert path.startswith("${output_dir}/"), (name, path)


def commit_all(repo: Path, message: str) -> None:
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.email=ci@eaglet", "-c", "user.name=eaglet", "commit", "-qm", message], repo)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_params(repo: Path, params: dict) -> None:
    """params.yaml as the resolved run config: every section a stage names in dvc.yaml is present."""
    from contract.config import RunConfig
    from contract.config_loading import config_as_yaml

    (repo / "params.yaml").write_text(config_as_yaml(RunConfig.model_validate(params)))
