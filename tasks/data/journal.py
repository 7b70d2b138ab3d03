"""An append-only journal of finished work, committed in chunks, so a killed stage resumes where it stopped.

The first line holds a fingerprint of the inputs and settings; a journal written under another
fingerprint is discarded rather than mixed in. A `{"server": identity}` line says which server wrote the entries
after it (tasks/data/served_model.py): the stage discards a journal another server wrote, so replies of another
model behind the same URL are not mixed in either. Each chunk is appended in one write and fsynced; a line
cut short by a kill is dropped on reading (its chunk is simply done again).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

#: The key of a line naming the server that wrote the entries after it.
SERVER = "server"


class Journal:
    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.server: Optional[dict[str, Any]] = None  # the identity of the last server line read or written

    def load(self) -> dict[str, dict[str, Any]]:
        """Committed entries by key; starts a fresh journal when absent or written for other inputs."""
        entries: dict[str, dict[str, Any]] = {}
        valid_bytes = 0
        if self.path.is_file():
            with open(self.path, "rb") as handle:
                header = handle.readline()
                if self.header_matches(header):
                    valid_bytes = len(header)
                    for line in handle:
                        entry = self.parse(line)
                        if entry is None:
                            break
                        if SERVER in entry:
                            self.server = entry[SERVER]
                        else:
                            entries[entry["key"]] = entry
                        valid_bytes += len(line)
        if valid_bytes == 0:
            self.start()
        else:
            with open(self.path, "r+b") as handle:
                handle.truncate(valid_bytes)
        return entries

    def header_matches(self, line: bytes) -> bool:
        entry = self.parse(line)
        return entry is not None and entry.get("fingerprint") == self.fingerprint

    @staticmethod
    def parse(line: bytes) -> dict[str, Any] | None:
        if not line.endswith(b"\n"):
            return None
        try:
            return json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None

    def start(self) -> None:
        """An empty journal: only the fingerprint line."""
        self.server = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "wb") as handle:
            handle.write(json.dumps({"fingerprint": self.fingerprint}).encode() + b"\n")
            handle.flush()
            os.fsync(handle.fileno())

    def commit(self, entries: list[dict[str, Any]]) -> None:
        """Append a chunk of entries in one write."""
        payload = b"".join(json.dumps(entry, ensure_ascii=False).encode("utf-8") + b"\n" for entry in entries)
        with open(self.path, "ab") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())

    def note_server(self, identity: dict[str, Any]) -> None:
        """Say which server writes the entries committed from now on."""
        self.commit([{SERVER: identity}])
        self.server = identity

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
