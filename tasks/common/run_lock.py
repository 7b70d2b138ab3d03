"""One run per output directory: `<output_dir>/.eaglet.lock` names the process that holds it.

Two runs writing the same output_dir (a cron deployment overlapping a manual run) would interleave their
artifacts, so the second refuses at once, naming the holder. The lock is a small JSON file created exclusively:
it is written under a private name and hard-linked into place, so it appears whole or not at all. A lock left by
a killed run on this host (its pid is gone) is taken over; one from another host cannot be checked and refuses.
Nested acquisition in one process (the CLI, then the flow it calls) is counted; the file goes at the outermost exit.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterator, Optional

from tasks.common.artifacts import write_json

LOCK_NAME = ".eaglet.lock"

#: Stale-lock takeovers tried before giving up: each retry means another run was starting at the same moment.
TAKEOVER_ATTEMPTS = 3


class RunLocked(RuntimeError):
    """The output directory is held by another run (or its lock cannot be judged); the message says what to do."""


@dataclass(frozen=True)
class LockHolder:
    """What the lock file records: enough for a person to find the holding process."""

    pid: int
    host: str
    started: str
    purpose: str
    command: str

    @classmethod
    def this_process(cls, purpose: str) -> LockHolder:
        started = datetime.now().astimezone().isoformat(timespec="seconds")
        return cls(os.getpid(), socket.gethostname(), started, purpose, shlex.join(sys.argv))

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}, running {self.purpose!r}"


#: Locks this process holds: lock path -> (the record written, nesting depth).
_held: dict[Path, tuple[LockHolder, int]] = {}
_held_guard = threading.Lock()


@contextmanager
def output_dir_lock(output_path: Path, purpose: str) -> Iterator[LockHolder]:
    """Hold `output_path` for this run (creating the directory); raise RunLocked when another run holds it."""
    output_path.mkdir(parents=True, exist_ok=True)
    lock_path = output_path.resolve() / LOCK_NAME
    holder = enter(lock_path, purpose)
    try:
        yield holder
    finally:
        leave(lock_path)


def enter(lock_path: Path, purpose: str) -> LockHolder:
    """Take the lock, or count one more level when this process already holds it."""
    with _held_guard:
        if lock_path in _held:
            holder, depth = _held[lock_path]
            _held[lock_path] = (holder, depth + 1)
            return holder
        holder = acquire(lock_path, LockHolder.this_process(purpose))
        _held[lock_path] = (holder, 1)
        return holder


def leave(lock_path: Path) -> None:
    """Undo one `enter`; the outermost one removes the file."""
    with _held_guard:
        holder, depth = _held[lock_path]
        if depth > 1:
            _held[lock_path] = (holder, depth - 1)
            return
        del _held[lock_path]
        release(lock_path, holder)


def acquire(lock_path: Path, ours: LockHolder) -> LockHolder:
    """Create the lock; when one exists, refuse unless it is stale, and then take it over."""
    for _ in range(TAKEOVER_ATTEMPTS):
        if create_exclusively(lock_path, ours):
            return ours
        text = read_lock_text(lock_path)
        if text is None:
            continue  # released between our attempt and the read
        existing = parse_holder(lock_path, text)
        refuse_unless_stale(lock_path, existing)
        if remove_if_unchanged(lock_path, text):
            print(f"[lock] {lock_path}: took over the stale lock of {existing.describe()}; that process is gone",
                  flush=True)
    raise RunLocked(f"{lock_path.parent} could not be locked after {TAKEOVER_ATTEMPTS} attempts: other runs are "
                    f"starting on it at the same moment; run one at a time")


def create_exclusively(lock_path: Path, holder: LockHolder) -> bool:
    """Write the record under a private name and hard-link it into place; the link fails when a lock exists."""
    draft = lock_path.with_name(f"{lock_path.name}.{holder.pid}.new")
    write_json(draft, asdict(holder))
    try:
        os.link(draft, lock_path)
        return True
    except FileExistsError:
        return False
    finally:
        draft.unlink(missing_ok=True)


def read_lock_text(lock_path: Path) -> Optional[str]:
    try:
        return lock_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def parse_holder(lock_path: Path, text: str) -> LockHolder:
    """The record in a lock file; a file eaglet cannot read refuses (it is never written half-way)."""
    try:
        data = json.loads(text)
        holder = LockHolder(int(data["pid"]), str(data["host"]), str(data["started"]),
                            str(data.get("purpose", "unknown")), str(data.get("command", "unknown")))
    except (ValueError, KeyError, TypeError) as error:
        raise RunLocked(f"{lock_path} is not a lock file eaglet can read ({type(error).__name__}: {error}); "
                        f"if no run is using {lock_path.parent}, remove it") from None
    if holder.pid <= 0:
        raise RunLocked(f"{lock_path} names pid {holder.pid}, which is no process; "
                        f"if no run is using {lock_path.parent}, remove it")
    return holder


def refuse_unless_stale(lock_path: Path, holder: LockHolder) -> None:
    """Raise RunLocked unless the holder is a process of this host that is gone."""
    directory = lock_path.parent
    if holder.host != socket.gethostname():
        raise RunLocked(f"{directory} is locked by {holder.describe()}; that is another host, so whether it still "
                        f"runs cannot be checked from here: wait for it, or if that process is gone remove {lock_path}")
    if holder.pid == os.getpid():
        return  # this process never took it (it would be in _held): a killed run's pid, reused by us
    if process_alive(holder.pid):
        raise RunLocked(f"{directory} is in use by {holder.describe()} (command: {holder.command}); wait for it to finish "
                        f"or use another output_dir (if pid {holder.pid} is not that run, remove {lock_path})")


def process_alive(pid: int) -> bool:
    """Whether `pid` exists on this host; a process we may not signal still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_if_unchanged(lock_path: Path, stale_text: str) -> bool:
    """Remove the lock judged stale, and only that one: a run starting at the same moment may have replaced it.

    The rename moves aside whatever is there now, atomically; a lock that is not the stale one is put back.
    """
    aside = lock_path.with_name(f"{lock_path.name}.{os.getpid()}.stale")
    try:
        os.rename(lock_path, aside)
    except FileNotFoundError:
        return False  # another run removed it first
    if aside.read_text(encoding="utf-8") == stale_text:
        aside.unlink()
        return True
    put_back(aside, lock_path)
    return False


def put_back(aside: Path, lock_path: Path) -> None:
    try:
        os.link(aside, lock_path)
    except FileExistsError:
        pass  # yet another run locked in between; its lock stands
    aside.unlink()


def release(lock_path: Path, holder: LockHolder) -> None:
    """Remove the lock file if it still names this process (a forked child never removes its parent's lock)."""
    if holder.pid != os.getpid():
        return
    text = read_lock_text(lock_path)
    if text is None:
        return
    try:
        recorded = json.loads(text)
    except ValueError:
        return
    if recorded == asdict(holder):
        lock_path.unlink(missing_ok=True)
