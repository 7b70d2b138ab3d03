"""The held-out records that evaluate decodes, benchmark serves and register fingerprints.

All three stages must see exactly the same prompts, so they all select them here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from contract.chat_rendering import is_supervised
from contract.records import Message, PromptRecord, read_prompt_records


def select_records(path: Path, max_records: Optional[int], sources: Optional[list[str]]) -> list[PromptRecord]:
    """The held-out records evaluated (and benchmarked: both stages must see the same prompts)."""
    records = [record for record in read_records(path) if sources is None or record.source in sources]
    if max_records is not None and len(records) > max_records:
        records = [records[index * len(records) // max_records] for index in range(max_records)]
    return records


def turn_prefixes(record: PromptRecord) -> list[list[Message]]:
    """The conversation before each supervised assistant turn: what a chat client sends for that turn."""
    return [record.messages[:index] for index, message in enumerate(record.messages) if is_supervised(message)]


def read_records(path: Path) -> list[PromptRecord]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no held-out records; run the validate stage first")
    return [record for _, record in read_prompt_records(path)]
