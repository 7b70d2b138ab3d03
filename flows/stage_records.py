"""What a pipeline stage hands Prefect to persist: a plain JSON record, never a pickle.

Prefect stores each stage's result under `<output_dir>/.prefect-results/<cache key>` and reads it back on a cache
hit. It picks the deserializer from the stored file itself, so configuring JSON is not enough: anyone who can
write the output directory could plant a pickle record and have it run on the next cached run. So a stage
returns only its summary numbers and report paths as plain JSON, and before Prefect looks up a key,
`set_aside_unsafe_record` moves away any record there that is not plain JSON (the stage then simply runs again).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from contract.config import RunConfig

#: Prefect's name of the serializer that writes the result as JSON text inside the record.
JSON_SERIALIZER = "json"
#: How Prefect's JSON encoder marks an object to rebuild from an importable class: never in our records.
CLASS_MARKER = "__class__"


class StageFailed(RuntimeError):
    """A stage of the pipeline failed; the message names it and carries the stage's own error."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"stage {stage} failed: {type(error).__name__}: {error}")
        self.stage = stage


@dataclass(frozen=True)
class StageRecord:
    """A stage's summary numbers and report files: what the flow logs and returns, as Prefect persists it."""

    values: dict[str, float]
    report_paths: list[str]

    def summary(self) -> dict[str, float]:
        return dict(self.values)

    def reports(self) -> list[Path]:
        return [Path(path) for path in self.report_paths]

    def as_json(self) -> dict[str, Any]:
        return {"summary": self.values, "reports": self.report_paths}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "StageRecord":
        return cls({key: float(value) for key, value in data["summary"].items()}, [str(path) for path in data["reports"]])


def recorded(function: Callable[[RunConfig], Any]) -> Callable[[RunConfig], dict[str, Any]]:
    """The stage function returning its StageRecord as a plain dict (what Prefect serializes as JSON)."""

    @functools.wraps(function)
    def stage(cfg: RunConfig) -> dict[str, Any]:
        from tasks.common.devices import release_device_memory

        try:
            result = function(cfg)
        finally:
            release_device_memory()  # the next stage may start an engine on the same GPU
        values = {key: float(value) for key, value in result.summary().items()}
        return StageRecord(values, [str(path) for path in result.reports()]).as_json()

    return stage


def is_plain_json_record(content: bytes) -> bool:
    """A Prefect result record written with the JSON serializer whose result holds no class to rebuild."""
    try:
        record = json.loads(content)
        serializer = record["metadata"]["serializer"]["type"]
        result = record["result"]
        payload = json.loads(result) if isinstance(result, (str, bytes)) else result
    except (ValueError, KeyError, TypeError):
        return False
    return serializer == JSON_SERIALIZER and not names_a_class(payload)


def read_stage_record(path: Path) -> StageRecord:
    """The StageRecord Prefect persisted at `path` (refused unless it is a plain JSON record)."""
    content = path.read_bytes()
    if not is_plain_json_record(content):
        raise ValueError(f"{path} is not a plain JSON stage record")
    result = json.loads(content)["result"]
    return StageRecord.from_json(json.loads(result) if isinstance(result, (str, bytes)) else result)


def names_a_class(value: Any) -> bool:
    if isinstance(value, dict):
        return CLASS_MARKER in value or any(names_a_class(item) for item in value.values())
    if isinstance(value, list):
        return any(names_a_class(item) for item in value)
    return False


def set_aside_unsafe_record(path: Path) -> bool:
    """Move a record that is not plain JSON to `<name>.refused` (it is never read); True when one was moved."""
    if not path.is_file() or is_plain_json_record(path.read_bytes()):
        return False
    refused = path.with_name(f"{path.name}.refused")
    os.replace(path, refused)
    print(f"[cache] {path} is not a plain JSON stage record (a pickle would run code when read): moved to "
          f"{refused}; the stage runs again", flush=True)
    return True
