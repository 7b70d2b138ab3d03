"""`eaglet inspect SAMPLE_ID`: one record after templating, token by token, with its loss mask.

The rows come from the same rendering and masking code the validate and capture stages use, so what a
person reads here is exactly what the drafter is trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.chat_rendering import TURN_SUFFIX, CutTurns, render_samples, tokenize_with_mask
from contract.config import RunConfig
from contract.records import PromptRecord

SEARCH_ORDER = ("train.jsonl", "eval.jsonl", "regenerated.jsonl")


@dataclass
class TokenRow:
    position: int
    token_id: int
    token: str
    loss_mask: int


@dataclass
class FeatureRow:
    """One captured row: what the target predicts after this token (its top-1), next to the token itself."""

    row: int
    token_id: int
    loss_mask: int
    teacher_id: int


def find_record(cfg: RunConfig, sample_id: str) -> tuple[PromptRecord, Path]:
    """The record with this id (a turn sample's id `<record id>#turn<i>` names its record) from the latest data
    file that holds it."""
    sample_id = sample_id.split(TURN_SUFFIX)[0]
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


def inspection_rows(tokenizer: Any, record: PromptRecord, max_length: int, cut_turns: CutTurns = "no_end",
                    sample_id: str = "") -> list[TokenRow]:
    """The tokens of the sample `sample_id` names (the record's first sample when it names no turn)."""
    samples = render_samples(tokenizer, record, cut_turns)
    suffix = sample_id[len(record.id):] if sample_id.startswith(record.id) else ""
    chosen = next((turn for turn in samples if turn.suffix == suffix), samples[0])
    sample = tokenize_with_mask(tokenizer, chosen.rendered, max_length)
    return [
        TokenRow(position, token_id, tokenizer.decode([token_id]), mask)
        for position, (token_id, mask) in enumerate(zip(sample.input_ids, sample.loss_mask))
    ]


def find_feature_record(features_dir: Path, sample_id: str) -> tuple[dict[str, Any], str]:
    """The captured record with this id, from the train or eval features."""
    from tasks.features.shards import FeatureSet

    for split in ("train", "eval"):
        for record in FeatureSet(features_dir, split):
            if record["id"] == sample_id:
                return record, split
    raise KeyError(f"no captured features for '{sample_id}' under {features_dir}")


def feature_rows(record: dict[str, Any], lm_head_weight: Any) -> list[FeatureRow]:
    """Per row: the stored token and mask, and the target's top-1 (the teacher for the following token)."""
    import torch

    if "target_top1" in record:
        teacher = record["target_top1"].long()
    else:
        with torch.no_grad():
            teacher = (record["hidden_state"].float() @ lm_head_weight.float().T).argmax(-1)
    return [
        FeatureRow(row, int(token), int(mask), int(top1))
        for row, (token, mask, top1) in enumerate(zip(record["input_ids"], record["loss_mask"], teacher))
    ]
