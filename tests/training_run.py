"""A captured run on the tiny target, ready for the train stage (shared by the training tests).

The answers are the target's own greedy text, as the regenerate stage writes them, so the drafter learns the
target's distribution; `data/eval.jsonl` holds only prompts that no training record has, so every eval metric
is measured on records the drafter was not trained on.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from contract.config import RunConfig
from tasks import capture, target

QUESTIONS = [
    "What is the capital of France?",
    "Hello, how are you today?",
    "Tell me a story about a small bird.",
    "Write a Python function that adds two numbers.",
    "What is the quick brown fox?",
    "Say hello.",
]
#: The eval records' prompts: in the training prompts' style and words, and none of them.
HELD_OUT_QUESTIONS = [
    "Tell me a story about a quick brown fox.",
    "Write a Python function that adds three numbers.",
]
ANSWER_TOKENS = 24


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


def whole_word_target(source: Path, destination: Path) -> Path:
    """The peaked tiny target that only ever emits whole-word tokens (' fox', ' the').

    The random target otherwise emits byte fragments that decode to U+FFFD, so its greedy text does not
    tokenize back to what it generated and a drafter trained on that text never sees the target's tokens.
    A word after a space is its own pre-token, so text made of these tokens tokenizes back to the same ids.
    """
    peaked_target(source, destination)
    tokenizer = AutoTokenizer.from_pretrained(destination)
    model = AutoModelForCausalLM.from_pretrained(destination, dtype=torch.float32)
    words = [token for token in range(len(tokenizer)) if is_whole_word(tokenizer, token)]
    keep = torch.zeros(len(tokenizer), dtype=torch.bool)
    keep[words] = True
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0.0  # logit 0 loses to the x20 logits of the words
    model.save_pretrained(destination)
    return destination


def is_whole_word(tokenizer: Any, token: int) -> bool:
    text = tokenizer.decode([token])
    return bool(re.fullmatch(r" [A-Za-z]+", text)) and tokenizer.encode(text, add_special_tokens=False) == [token]


def greedy_answers(model_dir: Path, questions: list[str], max_new_tokens: int) -> list[str]:
    """The target's greedy reply to each question asked alone."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    answers = []
    for question in questions:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
        with torch.no_grad():
            output = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.eos_token_id)
        answers.append(tokenizer.decode(output[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True))
    return answers


def record(index: int, question: str, answer: str) -> dict[str, Any]:
    return {"id": f"chats:{index}", "source": "chats", "split": "auto",
            "provenance": {"file": "chats.jsonl", "line": index + 1, "format": "openai"},
            "messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": answer, "supervised": True}]}


def write_records(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def self_distilled_run(cfg: RunConfig) -> RunConfig:
    """target, then the target's own greedy answers to QUESTIONS as both train and eval records, capture and train:
    the engine then generates exactly what the drafter was trained on (serving tests, not generalisation)."""
    from tasks import train

    target.run(cfg)
    answers = greedy_answers(cfg.output_path / "target", QUESTIONS, max_new_tokens=ANSWER_TOKENS)
    rows = [record(index, question, answer) for index, (question, answer) in enumerate(zip(QUESTIONS, answers))]
    write_records(cfg.output_path / "data" / "train.jsonl", rows)
    write_records(cfg.output_path / "data" / "eval.jsonl", rows)
    capture.run(cfg)
    train.run(cfg)
    return cfg


def captured_run(directory: Path, tiny_target_dir: Path, **training: Any) -> RunConfig:
    """target + train/eval jsonl (the target's answers; eval = the held-out questions) + capture under
    `directory`; returns the run config. It trains in fp32, the reference every host computes alike (the tests
    of `auto` and bf16 set their own precision)."""
    model_dir = whole_word_target(tiny_target_dir, directory.parent / "word-target")
    cfg = RunConfig.model_validate({
        "output_dir": str(directory), "model": {"source": "local", "path": str(model_dir)},
        "capture": {"aux_layer_ids": [1, 2, 3], "dtype": "float32", "draft_vocab_size": 128, "records_per_shard": 2},
        "training": {"ttt_length": 3, "learning_rate": 3e-3, "tokens_per_step": 64, "epochs": 4, "warmup_ratio": 0.1,
                     "save_interval": 4, "eval_interval": 4, "precision": "fp32", **training},
        "tracking": {"enabled": False},
    })
    target.run(cfg)
    questions = QUESTIONS + HELD_OUT_QUESTIONS
    answers = greedy_answers(cfg.output_path / "target", questions, ANSWER_TOKENS)
    rows = [record(index, question, answer) for index, (question, answer) in enumerate(zip(questions, answers))]
    data = directory / "data"
    write_records(data / "train.jsonl", rows[:len(QUESTIONS)])
    write_records(data / "eval.jsonl", rows[len(QUESTIONS):])
    capture.run(cfg)
    return cfg


def copied_run(shared: RunConfig, directory: Path, **training: Any) -> RunConfig:
    """The session's captured run (conftest `captured_tiny_run`) copied to `directory`, with `training` settings:
    a module that trains or evaluates in place starts from its own copy instead of capturing again."""
    copy_run(shared.output_path, directory)
    return shared.model_copy(update={"output_dir": str(directory),
                                     "training": shared.training.model_copy(update=training)})


def copy_run(source: Path, destination: Path) -> None:
    """A second run directory with the same target and features (fresh checkpoints)."""
    def outputs_of_training(directory: str, names: list[str]) -> list[str]:
        return [name for name in names if name in ("checkpoints", "train", "draft")] if Path(directory) == source else []

    shutil.copytree(source, destination, ignore=outputs_of_training)
