"""One run per output_dir: a live holder refuses a second run (the module, `eaglet stage`, the Prefect flow), a
killed run's lock is taken over, nesting in one process is counted. Holders are real processes, not mocks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from pipeline_inputs import tiny_run_config, write_conversations
from tasks.common.run_lock import LOCK_NAME, RunLocked, output_dir_lock

REPO_ROOT = Path(__file__).resolve().parents[1]

#: A second process holding the lock until it is killed; it prints "ready" once it holds it.
HOLDER = """\
import sys, time
from pathlib import Path
from tasks.common.run_lock import output_dir_lock

with output_dir_lock(Path(sys.argv[1]), "the test holder"):
    print("ready", flush=True)
    time.sleep(600)
"""


def repo_env() -> dict[str, str]:
    """The environment of a child process that imports this checkout (not whatever the venv points at)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


@contextmanager
def holder_process(output_dir: Path) -> Iterator[subprocess.Popen]:
    """A live process of this host holding output_dir's lock; killed (leaving its lock stale) on exit."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(output_dir)], cwd=REPO_ROOT, env=repo_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first_line = process.stdout.readline()
        assert first_line.strip() == "ready", f"the holder did not take the lock: {first_line}{process.stdout.read()}"
        yield process
    finally:
        process.kill()
        process.wait()
        process.stdout.close()


def lock_record(output_dir: Path) -> dict:
    return json.loads((output_dir / LOCK_NAME).read_text())


def dead_pid() -> int:
    """The pid of a process of this host that has exited and been reaped."""
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                              check=True)
    return int(finished.stdout)


def write_lock(output_dir: Path, pid: int, host: str) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_NAME
    path.write_text(json.dumps({"pid": pid, "host": host, "started": "2024-01-02T03:04:05+00:00",
                                "purpose": "eaglet run (all stages)", "command": "eaglet run"}))
    return path


def ingest_config(tmp_path: Path) -> tuple[Path, Path]:
    """A run config whose ingest stage needs no model (and no MLflow); returns (config, output_dir)."""
    chats = write_conversations(tmp_path / "inputs" / "chats.jsonl")
    out = tmp_path / "out"
    config = tiny_run_config(str(out), tmp_path / "no-model-needed", str(chats), {"enabled": False})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, out


def test_a_live_holder_refuses_a_second_run_naming_pid_host_and_start(tmp_path: Path, subprocesses: None) -> None:
    out = tmp_path / "out"
    with holder_process(out) as holder:
        record = lock_record(out)
        with pytest.raises(RunLocked) as refused:
            with output_dir_lock(out, "the second run"):
                pytest.fail("took a lock a live process holds")
        assert lock_record(out) == record, "the refused run left the holder's lock alone"
    message = str(refused.value)
    assert record["pid"] == holder.pid
    assert f"pid {holder.pid}" in message and socket.gethostname() in message and record["started"] in message
    assert "the test holder" in message and str(out.resolve()) in message


def eaglet(*arguments: str) -> subprocess.CompletedProcess:
    """`eaglet ARGUMENTS` of this checkout, as a separate process."""
    return subprocess.run([sys.executable, "-m", "flows.cli", *arguments], cwd=REPO_ROOT, env=repo_env(),
                          capture_output=True, text=True, timeout=600)


def test_eaglet_stage_and_run_refuse_while_another_process_holds_the_output_dir(tmp_path: Path, subprocesses: None) -> None:
    config, out = ingest_config(tmp_path)
    with holder_process(out) as holder:
        refused = {"stage ingest": eaglet("stage", "ingest", "--config", str(config)),
                   "run": eaglet("run", "--stages", "ingest", "--config", str(config))}
        assert sorted(os.listdir(out)) == [LOCK_NAME], "the refused commands wrote nothing"
    for what, completed in refused.items():
        output = completed.stdout + completed.stderr
        assert completed.returncode == 1, output
        assert f"{what} refused" in output and f"pid {holder.pid}" in output, output
        assert "Traceback" not in output

    taken_over = eaglet("stage", "ingest", "--config", str(config))
    assert taken_over.returncode == 0, taken_over.stdout + taken_over.stderr
    assert f"took over the stale lock of pid {holder.pid}" in taken_over.stdout
    assert (out / "data" / "prompts.jsonl").is_file()
    assert not (out / LOCK_NAME).exists(), "the stage released the lock when it finished"


def test_a_killed_runs_lock_on_this_host_is_taken_over(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                      subprocesses: None) -> None:
    out = tmp_path / "out"
    gone = dead_pid()
    write_lock(out, gone, socket.gethostname())
    with output_dir_lock(out, "the new run"):
        record = lock_record(out)
        assert (record["pid"], record["host"], record["purpose"]) == (os.getpid(), socket.gethostname(), "the new run")
    assert f"took over the stale lock of pid {gone}" in capsys.readouterr().out
    assert not (out / LOCK_NAME).exists()


def test_a_lock_from_another_host_or_unreadable_refuses_and_stays(tmp_path: Path, subprocesses: None) -> None:
    out = tmp_path / "out"
    foreign = write_lock(out, dead_pid(), "gpu-node-7")
    with pytest.raises(RunLocked, match="gpu-node-7.*another host"):
        with output_dir_lock(out, "the new run"):
            pytest.fail("took a lock another host holds")
    assert json.loads(foreign.read_text())["host"] == "gpu-node-7"

    foreign.write_text("{not json")
    with pytest.raises(RunLocked, match="not a lock file eaglet can read"):
        with output_dir_lock(out, "the new run"):
            pytest.fail("took a lock it cannot read")
    assert foreign.read_text() == "{not json"


def test_nested_locks_in_one_process_release_at_the_outermost_exit(tmp_path: Path) -> None:
    out = tmp_path / "not-yet-created"
    with output_dir_lock(out, "eaglet run (all stages)"):
        with output_dir_lock(out, "eaglet-pipeline flow (ingest)"):
            assert lock_record(out)["purpose"] == "eaglet run (all stages)", "the inner level reuses the outer lock"
        assert (out / LOCK_NAME).is_file(), "the inner exit keeps the lock"
    assert not (out / LOCK_NAME).exists()


def test_a_lock_that_no_longer_names_this_process_is_not_removed(tmp_path: Path, subprocesses: None) -> None:
    out = tmp_path / "out"
    with output_dir_lock(out, "the first run"):
        replaced = write_lock(out, dead_pid(), "gpu-node-7")
    assert replaced.is_file() and lock_record(out)["host"] == "gpu-node-7"


def test_the_pipeline_flow_refuses_a_held_output_dir(prefect_harness, tmp_path: Path) -> None:
    from flows.pipeline import pipeline

    config, out = ingest_config(tmp_path)
    with holder_process(out) as holder:
        state = pipeline(str(config), [], ["ingest"], return_state=True)
        assert sorted(os.listdir(out)) == [LOCK_NAME], "the refused flow ran no stage"
    assert state.is_failed()
    assert "RunLocked" in state.message and f"pid {holder.pid}" in state.message, state.message
