"""Writing artifacts so that a crash never leaves a half-written file or directory behind.

Everything goes to a temporary sibling first and is renamed into place: a reader sees the old
artifact or the new one, never a mix.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from pydantic import BaseModel


@contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[Any]:
    """Open a temp file beside `path`; on success fsync and rename it onto `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle_fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.chmod(temp_name, 0o666 & ~current_umask())  # mkstemp makes 0600; artifacts get the usual mode
    try:
        encoding = None if "b" in mode else "utf-8"
        with os.fdopen(handle_fd, mode, encoding=encoding) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: Path, data: Any) -> None:
    """Atomically write JSON (pydantic models are dumped in JSON mode)."""
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
    with atomic_file(path) as handle:
        json.dump(data, handle, indent=2, ensure_ascii=False)
        handle.write("\n")


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def write_jsonl(path: Path, rows: Iterable[Any]) -> int:
    """Atomically write one JSON object per line; returns the number of rows."""
    count = 0
    with atomic_file(path) as handle:
        for row in rows:
            if isinstance(row, BaseModel):
                row = row.model_dump(mode="json", exclude_none=True)
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


@contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Build a directory under a temp name; on success replace `path` with it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(temp, 0o777 & ~current_umask())
    try:
        yield temp
        if path.exists():
            retired = path.with_name(f".{path.name}.old")
            shutil.rmtree(retired, ignore_errors=True)
            os.replace(path, retired)
            os.replace(temp, path)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(temp, path)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def link_or_copy(source: Path, destination: Path) -> None:
    """Hard-link a (large, immutable) file when the filesystem allows, else copy it (a link left by an earlier,
    killed run is kept)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    if destination.exists():
        if os.path.samefile(source, destination):
            return
        destination.unlink()  # never write through it: it may be a hard link to another run's file
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def save_figure(figure: Any, path: Path) -> Path:
    """A matplotlib figure as PNG, written atomically, and closed (figures stay in memory until closed)."""
    import matplotlib.pyplot as plt

    with atomic_file(path, "wb") as handle:
        figure.savefig(handle, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return path
