"""`eaglet inspect`: the loss mask covers exactly the assistant turns, end-of-turn token included."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer
from typer.testing import CliRunner

from contract.config import RunConfig
from contract.records import Message, PromptRecord, Provenance
from flows.cli import app
from tasks import target
from tasks.inspect_sample import inspection_rows

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
