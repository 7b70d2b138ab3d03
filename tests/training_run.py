"""A captured run on the tiny target, ready for the train stage (shared by the training tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from contract.config import RunConfig
from tasks import capture, target

QUESTIONS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Hello, how are you today?", "I am fine, thank you."),
    ("Tell me a story about a small bird.", "A small bird learns to fly over the sea."),
    ("Write a Python function that adds two numbers.", "def add(a, b): return a + b"),
    ("What is the quick brown fox?", "The quick brown fox jumps over the lazy dog."),
    ("Say hello.", "Hello, how are you today?"),
]


def peaked_target(source: Path, destination: Path) -> Path:
    """The tiny target with a peaked next-token distribution, like a trained LM."""
    if (destination / "config.json").is_file():
        return destination
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(destination)
    AutoTokenizer.from_pretrained(source).save_pretrained(destination)
    return destination


def record(index: int, question: str, answer: str) -> dict[str, Any]:
    return {"id": f"chats:{index}", "source": "chats", "split": "auto",
            "provenance": {"file": "chats.jsonl", "line": index + 1, "format": "openai"},
            "messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": answer, "supervised": True}]}


def captured_run(directory: Path, tiny_target_dir: Path, **training: Any) -> RunConfig:
    """target + train/eval jsonl + capture under `directory`; returns the run config."""
    model_dir = peaked_target(tiny_target_dir, directory.parent / "peaked-target")
    cfg = RunConfig.model_validate({
        "output_dir": str(directory), "model": {"source": "local", "path": str(model_dir)},
        "capture": {"aux_layer_ids": [1, 2, 3], "dtype": "float32", "draft_vocab_size": 128, "records_per_shard": 2},
        "training": {"ttt_length": 3, "learning_rate": 3e-3, "tokens_per_step": 64, "epochs": 4, "warmup_ratio": 0.1,
                     "save_interval": 4, "eval_interval": 4, **training},
        "tracking": {"enabled": False},
    })
    target.run(cfg)
    data = directory / "data"
    data.mkdir(parents=True, exist_ok=True)
    rows = [record(index, q, a) for index, (q, a) in enumerate(QUESTIONS)]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (data / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:2]))
    capture.run(cfg)
    return cfg


def copy_run(source: Path, destination: Path) -> None:
    """A second run directory with the same target and features (fresh checkpoints)."""
    def outputs_of_training(directory: str, names: list[str]) -> list[str]:
        return [name for name in names if name in ("checkpoints", "train", "draft")] if Path(directory) == source else []

    shutil.copytree(source, destination, ignore=outputs_of_training)
