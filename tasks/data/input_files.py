"""Reading input files item by item, so that one broken line becomes one error, not a failed stage.

Supported: JSONL (optionally .gz), JSON (an array of items, or an object mapping ids to items), parquet.
A JSON array that breaks off (a cut-off file, a stray byte) keeps every complete item before the break and
reports the rest as one error naming where it broke.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator


@dataclass
class RawItem:
    """One input item: parsed `data`, or `error` when it could not be parsed."""

    line: int
    data: Any = None
    key: str | None = None
    error: str | None = None


def file_kind(path: Path) -> str:
    name = path.name.lower()
    for suffix, kind in ((".jsonl.gz", "jsonl"), (".jsonl", "jsonl"), (".json.gz", "json"), (".json", "json"), (".parquet", "parquet")):
        if name.endswith(suffix):
            return kind
    raise ValueError(f"{path}: unsupported file type; expected .jsonl, .jsonl.gz, .json, .json.gz or .parquet")


def open_binary(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def iter_items(path: Path) -> Iterator[RawItem]:
    """Yield every item of the file, numbered from 1 (line for JSONL, position otherwise)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: input file not found")
    kind = file_kind(path)
    if kind == "jsonl":
        yield from iter_jsonl(path)
    elif kind == "json":
        yield from iter_json(path)
    else:
        yield from iter_parquet(path)


def iter_jsonl(path: Path) -> Iterator[RawItem]:
    with open_binary(path) as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield RawItem(number, error=f"not valid UTF-8: {error.reason} at byte {error.start}")
                continue
            if not line.strip():
                yield RawItem(number, error="blank line")
                continue
            try:
                yield RawItem(number, data=json.loads(line))
            except json.JSONDecodeError as error:
                yield RawItem(number, error=f"not valid JSON: {error.msg} at column {error.colno}")


def iter_json(path: Path) -> Iterator[RawItem]:
    try:
        with open_binary(path) as handle:
            text = handle.read().decode("utf-8")
    except UnicodeDecodeError as error:
        yield RawItem(1, error=f"file is not valid JSON: {error}")
        return
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("["):
            yield from iter_array_prefix(text)
        else:
            yield RawItem(1, error=f"file is not valid JSON: {error}")
        return
    if isinstance(document, list):
        for number, item in enumerate(document, start=1):
            yield RawItem(number, data=item)
    elif isinstance(document, dict) and document and all(isinstance(value, dict) for value in document.values()):
        for number, (key, item) in enumerate(document.items(), start=1):
            yield RawItem(number, data=item, key=str(key))
    else:
        yield RawItem(1, data=document)


def iter_array_prefix(text: str) -> Iterator[RawItem]:
    """The items of a JSON array that does not parse as a whole, one at a time up to where it breaks; the break
    is one error item (position: the first item not read) with the character offset and JSON's reason."""
    decoder = json.JSONDecoder()
    index = skip_whitespace(text, text.index("[") + 1)
    number = 0
    while True:
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError as error:
            yield RawItem(number + 1, error=f"the JSON array breaks off inside item {number + 1} at character "
                                            f"{error.pos} of {len(text)} ({error.msg}): the file is cut off or "
                                            f"corrupt there; the {number} items before it were read")
            return
        number += 1
        yield RawItem(number, data=item)
        index = skip_whitespace(text, index)
        if index < len(text) and text[index] == "]":
            return
        if index < len(text) and text[index] != ",":
            yield RawItem(number + 1, error=f"the JSON array breaks off after item {number} at character {index} "
                                            f"of {len(text)} (expected ',' or ']'); the {number} items before it "
                                            "were read")
            return
        index = skip_whitespace(text, index + 1)


def skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in " \t\r\n":
        index += 1
    return index


def iter_parquet(path: Path) -> Iterator[RawItem]:
    import pyarrow.parquet as parquet

    table = parquet.read_table(path)
    for number, row in enumerate(table.to_pylist(), start=1):
        yield RawItem(number, data=row)
