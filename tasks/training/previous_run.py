"""What a train invocation does with the outputs of the one before it: continue them or set them aside.

A resumed run cuts `train/steps.jsonl` back to its checkpoint's step (a killed run may have logged steps after
its last checkpoint; they are trained again, so they must not be listed twice) and replays the kept rows into
its MLflow run, whose step metrics then read as one uninterrupted run. A run that starts over never deletes a
previous run's checkpoints: they move, with its step log and exports, to `checkpoints.superseded-<time>/`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from tasks.common.artifacts import atomic_file

STEP_LOG = Path("train") / "steps.jsonl"
SUMMARY = Path("train") / "summary.json"
#: What a training run leaves in the output directory, besides its plot.
RUN_OUTPUTS = (Path("checkpoints"), STEP_LOG, SUMMARY, Path("draft"))


def read_step_log(output_path: Path) -> list[dict[str, Any]]:
    """The rows of train/steps.jsonl (none when there is no log)."""
    path = output_path / STEP_LOG
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def cut_step_log(output_path: Path, step: int) -> list[dict[str, Any]]:
    """Keep the rows up to `step` (the checkpoint a run resumes from), rewritten atomically; returns them."""
    rows = read_step_log(output_path)
    kept = [row for row in rows if row["step"] <= step]
    if len(kept) != len(rows):
        with atomic_file(output_path / STEP_LOG) as handle:
            for row in kept:
                handle.write(json.dumps(row) + "\n")
    return kept


def replay_step_metrics(tracker: Any, rows: list[dict[str, Any]]) -> None:
    """Log the kept rows into this invocation's MLflow run, so its history starts at step 1."""
    for row in rows:
        metrics = {f"train.{key}": value for key, value in row.items() if key != "step"}
        tracker.log_metrics(metrics, step=row["step"])


def set_aside(output_path: Path) -> Optional[Path]:
    """Move the previous run's checkpoints, step log, summary and exports to checkpoints.superseded-<time>/.

    Returns that folder, or None when there was nothing worth keeping (no checkpoint and no export: only the
    step log of a run killed before its first checkpoint, which is removed)."""
    present = [relative for relative in RUN_OUTPUTS if (output_path / relative).exists()]
    worth_keeping = (output_path / "checkpoints").is_dir() or (output_path / "draft").is_dir()
    if not worth_keeping:
        for relative in present:
            (output_path / relative).unlink()
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    folder = output_path / f"checkpoints.superseded-{stamp}"
    suffix = 1
    while folder.exists():
        folder = output_path / f"checkpoints.superseded-{stamp}-{suffix}"
        suffix += 1
    folder.mkdir()
    for relative in present:
        os.replace(output_path / relative, folder / relative.name)
    return folder
