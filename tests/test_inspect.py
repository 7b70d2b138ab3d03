"""`eaglet inspect`: the loss mask covers exactly the assistant turns, end-of-turn token included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from transformers import AutoTokenizer
from typer.testing import CliRunner

from contract.config import RunConfig
from contract.records import Message, PromptRecord, Provenance
from flows.cli import app
from tasks import target
from tasks.features.inspector import inspection_rows
from training_run import peaked_target

TWO_TURNS = PromptRecord(
    id="chats:two",
    source="chats",
    messages=[
        Message(role="system", content="Be brief."),
        Message(role="user", content="Hello, how are you?"),
        Message(role="assistant", content="I am fine.", supervised=True),
        Message(role="user", content="What is the capital of France?"),
        Message(role="assistant", content="Paris.", supervised=True),
    ],
    provenance=Provenance(file="chats.jsonl", line=1, format="sharegpt"),
)


def materialised(tmp_path: Path, tiny_target_dir: Path) -> RunConfig:
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path / "out"), "model": {"source": "local", "path": str(tiny_target_dir)}})
    target.run(cfg)
    return cfg


def test_mask_is_exactly_the_assistant_turns(tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = materialised(tmp_path, tiny_target_dir)
    tokenizer = AutoTokenizer.from_pretrained(cfg.output_path / "target")
    rows = inspection_rows(tokenizer, TWO_TURNS, max_length=512)
    supervised = "".join(row.token for row in rows if row.loss_mask)
    assert supervised == "I am fine.<|im_end|>Paris.<|im_end|>"
    masked_runs = [row.position for row in rows if row.loss_mask]
    assert rows[masked_runs[-1]].token == "<|im_end|>" and masked_runs[-1] == len(rows) - 2, "trailing newline unsupervised"
    last_only = TWO_TURNS.model_copy(deep=True)
    last_only.messages[2].supervised = False
    assert "".join(row.token for row in inspection_rows(tokenizer, last_only, 512) if row.loss_mask) == "Paris.<|im_end|>"
    truncated = inspection_rows(tokenizer, TWO_TURNS, max_length=10)
    assert len(truncated) == 10 and not any(row.loss_mask for row in truncated)


def test_pretemplated_text_is_masked_between_the_template_markers(tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = materialised(tmp_path, tiny_target_dir)
    tokenizer = AutoTokenizer.from_pretrained(cfg.output_path / "target")
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello there<|im_end|>\n"
    record = PromptRecord(id="t", source="s", text=text, provenance=Provenance(file="f", line=1, format="text"))
    assert "".join(row.token for row in inspection_rows(tokenizer, record, 512) if row.loss_mask) == "hello there<|im_end|>"


def test_inspect_command_prints_the_table(tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = materialised(tmp_path, tiny_target_dir)
    data = cfg.output_path / "data"
    data.mkdir(parents=True)
    (data / "train.jsonl").write_text(json.dumps(TWO_TURNS.model_dump(mode="json")) + "\n")
    runner = CliRunner()
    shown = runner.invoke(app, ["inspect", "chats:two", f"output_dir={cfg.output_path}"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert "loss_mask" in shown.output and "'aris'" in shown.output and "train.jsonl" in shown.output
    assert "supervised of" in shown.output
    missing = runner.invoke(app, ["inspect", "chats:absent", f"output_dir={cfg.output_path}"])
    assert missing.exit_code == 2 and "no record with id 'chats:absent'" in missing.output


def test_features_line_up_with_tokens_and_the_teacher_predicts_the_next_one(tmp_path: Path, tiny_target_dir: Path) -> None:
    from tasks import capture, ingest, regenerate
    from tasks.features.inspector import feature_rows, find_feature_record

    model_dir = peaked_target(tiny_target_dir, tmp_path / "peaked")
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"id": "two", "messages": [
        {"role": "user", "content": "Hello, how are you?"}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "What is the capital of France?"}]}) + "\n")
    cfg = RunConfig.model_validate({
        "output_dir": str(tmp_path / "out"), "model": {"source": "local", "path": str(model_dir)},
        "data": {"sources": [{"name": "chats", "path": str(chats)}]},
        "regeneration": {"max_new_tokens": 12, "dtype": "float32"}, "capture": {"aux_layer_ids": [1, 2, 3], "dtype": "float32"},
        "tracking": {"enabled": False},
    })
    target.run(cfg)
    ingest.run(cfg)
    regenerated = regenerate.run(cfg).output_path
    data = cfg.output_path / "data"
    (data / "train.jsonl").write_text(regenerated.read_text())
    (data / "eval.jsonl").write_text("")
    capture.run(cfg)

    tokenizer = AutoTokenizer.from_pretrained(cfg.output_path / "target")
    record = PromptRecord.model_validate_json(regenerated.read_text())
    rows = inspection_rows(tokenizer, record, cfg.validation.max_length)
    features, split = find_feature_record(cfg.output_path / "features", "chats:two")
    from models.target_loading import load_target

    model, _ = load_target(cfg.output_path / "target")
    captured = feature_rows(features, model.get_output_embeddings().weight)
    assert split == "train" and len(captured) == len(rows)
    assert [(f.row, f.token_id, f.loss_mask) for f in captured] == [(r.position, r.token_id, r.loss_mask) for r in rows]
    supervised = [r.position for r in rows if r.loss_mask]
    assert len(supervised) >= 4, "two generated turns, end-of-turn tokens included"
    import torch

    with torch.no_grad():
        direct = model(torch.tensor([[r.token_id for r in rows]])).logits[0].argmax(-1).tolist()
    assert [f.teacher_id for f in captured] == direct, "row t's teacher is the target's prediction after token t"

    shown = CliRunner().invoke(app, ["inspect", "chats:two", "--features", f"output_dir={cfg.output_path}"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    words = " ".join(shown.output.split())
    assert "teacher" in words and "learns the teacher of row t+1" in words


def test_smollm2_teacher_predicts_the_next_generated_token(tmp_path: Path, embedded_target: Path) -> None:
    """The alignment proof on the real target: after greedy regeneration, the teacher of row t-1 is token t."""
    from models.target_loading import load_target
    from tasks import capture, ingest, regenerate
    from tasks.features.inspector import feature_rows, find_feature_record

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": key, "messages": [{"role": "user", "content": text}]}) + "\n" for key, text in
                             [("a", "What is the capital of France?"), ("b", "Name three colours.")]))
    cfg = RunConfig.model_validate({
        "output_dir": str(tmp_path / "out"), "data": {"sources": [{"name": "chats", "path": str(chats)}]},
        "regeneration": {"max_new_tokens": 24, "dtype": "float32"}, "capture": {"dtype": "float32", "draft_vocab_size": 2048},
        "tracking": {"enabled": False},
    })
    target.run(cfg)
    ingest.run(cfg)
    regenerated = regenerate.run(cfg).output_path
    (cfg.output_path / "data" / "train.jsonl").write_text(regenerated.read_text())
    (cfg.output_path / "data" / "eval.jsonl").write_text("")
    capture.run(cfg)
    model, _ = load_target(cfg.output_path / "target")
    agreeing = supervised = 0
    for sample_id in ("chats:a", "chats:b"):
        rows = feature_rows(find_feature_record(cfg.output_path / "features", sample_id)[0], model.get_output_embeddings().weight)
        positions = [row.row for row in rows if row.loss_mask]
        agreeing += sum(rows[t - 1].teacher_id == rows[t].token_id for t in positions)
        supervised += len(positions)
    assert agreeing / supervised >= 0.95, (agreeing, supervised)
