"""Test tiers, applied at collection from the fixtures a test uses, and kept honest while the tests run.

- `unit`: no serving engine, no Prefect server, no subprocess, no listening socket. `make test-fast` runs these.
- `integration`: Prefect, DVC, torchrun, scripted servers, the real embedded model — anything that starts a
  process or a server, or reads the embedded SmolLM2.
- `engine`: a real serving engine (vLLM's CPU build, SGLang's loader environment).

A test's tier is the heaviest one its fixtures imply (`TIER_FIXTURES`), or the tier marker written on it (a module's
`pytestmark` or a decorator) where no fixture says it; with neither it is `unit`. Collection fails when a test ends
in no tier or in two (a written marker that disagrees with its fixtures, or two markers). While a `unit` test runs,
starting a process or listening on a socket fails it, naming what it did, so a test cannot sit in the fast tier by
mistake.
"""

from __future__ import annotations

import os
import socket
import subprocess
from typing import Iterable, Iterator

import pytest

TIERS: tuple[str, ...] = ("unit", "integration", "engine")

#: Fixtures that put a test in a tier (the heaviest wins).
TIER_FIXTURES: dict[str, str] = {
    "prefect_harness": "integration",
    "prefect_server": "integration",
    "scripted_server": "integration",
    "subprocesses": "integration",
    "embedded_target": "integration",
    "vllm_python": "engine",
    "sglang_loader_python": "engine",
}


class TierViolation(Exception):
    """A unit test did what only integration or engine tests may do."""


def fixture_tier(fixture_names: Iterable[str]) -> str | None:
    """The heaviest tier the fixtures imply, or None when none of them implies one."""
    implied = {TIER_FIXTURES[name] for name in fixture_names if name in TIER_FIXTURES}
    for tier in reversed(TIERS):
        if tier in implied:
            return tier
    return None


def written_tiers(item: pytest.Item) -> set[str]:
    """Tier markers written on the test (decorators, class or module `pytestmark`)."""
    return {marker.name for marker in item.iter_markers() if marker.name in TIERS}


def item_tiers(item: pytest.Item) -> set[str]:
    """Every tier the test claims: the fixtures' tier and the written markers (one element when consistent)."""
    tiers = written_tiers(item)
    implied = fixture_tier(getattr(item, "fixturenames", ()))
    if implied is not None:
        tiers.add(implied)
    if not tiers:
        tiers.add("unit")
    return tiers


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "unit: no engine, no Prefect server, no subprocess (make test-fast)")
    config.addinivalue_line("markers", "integration: Prefect, DVC, torchrun, scripted servers, the embedded model")
    config.addinivalue_line("markers", "engine: a real serving engine (vLLM CPU build, SGLang loader)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its one tier; refuse the collection when a test has none or several."""
    ambiguous = []
    for item in items:
        tiers = item_tiers(item)
        if len(tiers) != 1:
            fixtures = sorted(name for name in getattr(item, "fixturenames", ()) if name in TIER_FIXTURES)
            ambiguous.append(f"{item.nodeid}: tiers {sorted(tiers)} (markers {sorted(written_tiers(item))}, "
                             f"tier fixtures {fixtures})")
            continue
        (tier,) = tiers
        if tier not in written_tiers(item):
            item.add_marker(tier)
    if ambiguous:
        raise pytest.UsageError("every test must be in exactly one tier (tests/tiers.py):\n  " + "\n  ".join(ambiguous))


@pytest.fixture(autouse=True)
def unit_tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In a unit test, starting a process or listening on a socket raises, naming the tier it belongs in."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return

    def refuse(what: str) -> None:
        raise TierViolation(f"{request.node.nodeid} is a unit test but {what}: request a tier fixture "
                            f"({', '.join(sorted(TIER_FIXTURES))}) or mark it integration/engine (tests/tiers.py)")

    original_execute = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    original_listen = socket.socket.listen

    def execute_child(self: subprocess.Popen, args, *rest, **options):  # type: ignore[no-untyped-def]
        refuse(f"starts a process ({args if isinstance(args, str) else ' '.join(map(str, args))[:120]})")
        return original_execute(self, args, *rest, **options)

    def listen(self: socket.socket, *args) -> None:  # type: ignore[no-untyped-def]
        refuse(f"listens on a socket ({self.getsockname()})")
        original_listen(self, *args)

    def fork() -> int:
        refuse("forks a process")
        return -1

    monkeypatch.setattr(subprocess.Popen, "_execute_child", execute_child)
    monkeypatch.setattr(socket.socket, "listen", listen)
    monkeypatch.setattr(os, "fork", fork)
    yield
