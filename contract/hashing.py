"""Content hashes that identify artifacts by what they hold, not by where or when they were made."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

CHUNK = 1 << 20


def hash_text(text: str) -> str:
    """sha256 of a string (chat templates, canonical JSON)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def hash_files(paths: Iterable[Path], root: Path | None = None) -> str:
    """sha256 over (relative name, content) of each file in sorted order: a directory's immutable revision."""
    digest = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        name = str(path.relative_to(root)) if root is not None else path.name
        digest.update(name.encode("utf-8") + b"\0")
        with open(path, "rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def hash_file(path: Path) -> str:
    """sha256 of one file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
