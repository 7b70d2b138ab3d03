"""One look for progress bars across stages (rich), quiet when output is not a terminal."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


@contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Progress]:
    """A progress bar with one task; call `advance(bar)` per item."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        progress.add_task(description, total=total)
        yield progress


def advance(progress: Progress, amount: float = 1.0) -> None:
    progress.advance(progress.task_ids[0], amount)
