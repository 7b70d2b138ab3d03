"""One promotion at a time per registry: the lock held from reading the champion to moving its alias.

Two runs registering into one registry both read the champion, both gate against it and both move `champion`: the
second replaces the first without ever being compared with it. So tasks/register.py holds this lock, keyed on the
registry (its store and the model name), from "read the champion" through "move the alias"; a second run waits
for it and is then gated against the champion the first one left.

Where the lock is shared depends on the store. A sqlite database (what eaglet keeps under each output dir) or a
local file store is a path on this machine: an advisory `flock` on a file beside it, released by the kernel even
when the holder is killed, so no stale lock is ever left to judge. A tracking server or database on another host
(http, https, databricks, postgresql, ...) shares no file with the other runs: there the guard is a compare-and-set
on MLflow's side instead (tasks/registry/store.py `promote_if_unchanged`: the champion alias is read again right
before it moves and the move is refused when it changed since the comparison). That re-read is also done under the
file lock, where it can only agree.
"""

from __future__ import annotations

import fcntl
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, Optional
from urllib.parse import unquote, urlparse

#: How long a run waits for another run's promotion: a registration (logging two small exports) takes seconds.
WAIT_S = 600.0
POLL_S = 0.1
#: Characters kept from the model name in the lock file's name; anything else becomes "_".
NAME_CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_."

GuardKind = Literal["file lock", "compare-and-set"]


class PromotionLocked(RuntimeError):
    """Another run held the registry's promotion lock for longer than the wait; the message names the lock file."""


@dataclass(frozen=True)
class PromotionGuard:
    """How this promotion is kept from racing another: a file lock beside a local store, else compare-and-set."""

    kind: GuardKind
    lock_path: Optional[Path]

    def describe(self) -> str:
        if self.lock_path is not None:
            return f"{self.kind} {self.lock_path}"
        return f"{self.kind} on the champion alias (the store is not on this machine: no lock file is shared)"


def local_store_path(registry_uri: str) -> Optional[Path]:
    """The file or directory a registry URI keeps its records in when that is on this machine, else None."""
    parsed = urlparse(registry_uri)
    if parsed.scheme == "sqlite":
        database = registry_uri[len("sqlite:///"):].partition("?")[0] if registry_uri.startswith("sqlite:///") else ""
        return Path(unquote(database)).resolve() if database and database != ":memory:" else None
    if parsed.scheme == "file":
        return Path(unquote(parsed.path)).resolve()
    if parsed.scheme == "" and registry_uri:
        return Path(registry_uri).resolve()
    return None


def lock_path_for(registry_uri: str, model_name: str) -> Optional[Path]:
    """`<store>.<model>.promotion.lock` beside a sqlite database (inside a file store's directory); None for a
    store elsewhere."""
    store = local_store_path(registry_uri)
    if store is None:
        return None
    safe_name = "".join(char if char in NAME_CHARACTERS else "_" for char in model_name)
    if store.is_dir():
        return store / f".{safe_name}.promotion.lock"
    return store.with_name(f"{store.name}.{safe_name}.promotion.lock")


@contextmanager
def promotion_lock(registry_uri: str, model_name: str, wait_s: float = WAIT_S) -> Iterator[PromotionGuard]:
    """Hold the registry's promotion lock for `model_name` (waiting up to `wait_s` for another run's); on a store
    that is not on this machine, yield the compare-and-set guard without locking."""
    lock_path = lock_path_for(registry_uri, model_name)
    if lock_path is None:
        yield PromotionGuard("compare-and-set", None)
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a", encoding="utf-8") as handle:  # the file is never written: its lock is what counts
        wait_for(handle.fileno(), lock_path, model_name, wait_s)
        try:
            yield PromotionGuard("file lock", lock_path)
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def wait_for(descriptor: int, lock_path: Path, model_name: str, wait_s: float) -> None:
    """Take the exclusive lock, polling until `wait_s` has passed; then refuse, naming the lock file."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise PromotionLocked(
                    f"another run has been promoting {model_name} for over {wait_s:.0f} s (it holds {lock_path}); "
                    "wait for it and register again (the lock goes when that process ends)") from None
            time.sleep(POLL_S)
