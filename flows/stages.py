"""The stages that exist, in pipeline order, and how to reach each one's `run(cfg)`.

The same names are used by the CLI (`eaglet stage NAME`), the Prefect flow and dvc.yaml.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol

from contract.config import RunConfig

STAGE_ORDER: tuple[str, ...] = ("target", "ingest", "regenerate", "validate", "capture", "train", "evaluate",
                                  "benchmark", "register")


class StageResult(Protocol):
    def summary(self) -> dict[str, float]: ...

    def reports(self) -> list[Any]: ...


def stage_function(name: str) -> Callable[[RunConfig], StageResult]:
    """`tasks.<name>.run`, imported on demand (stages pull heavy libraries)."""
    if name not in STAGE_ORDER:
        raise KeyError(f"unknown stage '{name}'; stages: {', '.join(STAGE_ORDER)}")
    return importlib.import_module(f"tasks.{name}").run


def select_stages(names: list[str] | None) -> list[str]:
    """The requested stages in pipeline order (all when None)."""
    if not names:
        return list(STAGE_ORDER)
    unknown = [name for name in names if name not in STAGE_ORDER]
    if unknown:
        raise KeyError(f"unknown stage(s) {', '.join(unknown)}; stages: {', '.join(STAGE_ORDER)}")
    return [name for name in STAGE_ORDER if name in names]
