"""`eaglet inspect SAMPLE_ID`: one record after templating, token by token, with its loss mask.

The rows come from the same rendering and masking code the validate and capture stages use, so what a
person reads here is exactly what the drafter is trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.chat_rendering import render_with_spans, spans_in_pretemplated, tokenize_with_mask
from contract.config import RunConfig
from contract.records import PromptRecord

SEARCH_ORDER = ("train.jsonl", "eval.jsonl", "regenerated.jsonl")


@dataclass
class TokenRow:
    position: int
    token_id: int
    token: str
    loss_mask: int


def find_record(cfg: RunConfig, sample_id: str) -> tuple[PromptRecord, Path]:
    """The record with this id from the latest data file that holds it."""
    data_dir = cfg.output_path / "data"
    searched = []
    for name in SEARCH_ORDER:
        path = data_dir / name
        if not path.is_file():
            continue
        searched.append(str(path))
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if f'"id": "{sample_id}"' in line or f'"id":"{sample_id}"' in line:
                    record = PromptRecord.model_validate_json(line)
                    if record.id == sample_id:
                        return record, path
    where = ", ".join(searched) if searched else f"{data_dir} (no data files yet)"
    raise KeyError(f"no record with id '{sample_id}' in {where}")


def inspection_rows(tokenizer: Any, record: PromptRecord, max_length: int) -> list[TokenRow]:
    rendered = spans_in_pretemplated(tokenizer, record.text) if record.text is not None else render_with_spans(tokenizer, record.messages)
    sample = tokenize_with_mask(tokenizer, rendered, max_length)
    return [
        TokenRow(position, token_id, tokenizer.decode([token_id]), mask)
        for position, (token_id, mask) in enumerate(zip(sample.input_ids, sample.loss_mask))
    ]
