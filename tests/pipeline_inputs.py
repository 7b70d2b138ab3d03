"""Small run configs over the tiny target and a handwritten conversation file, shared by flow and DVC tests."""

from __future__ import annotations

import json
from pathlib import Path

CONVERSATIONS = [
    {"id": "c1", "conversations": [{"from": "human", "value": "Hello, how are you?"}, {"from": "gpt", "value": "Fine."}]},
    {"id": "c2", "messages": [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}]},
    {"id": "c3", "text": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"},
]


def write_conversations(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(item) for item in CONVERSATIONS] + ["{broken json"]
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_run_config(output_dir: str, model_dir: Path, chats: str, tracking: dict) -> dict:
    """A run config dict: the tiny local target plus one chat file and the MT-bench asset (limit 3)."""
    return {
        "run_id": "tiny",
        "output_dir": output_dir,
        "model": {"source": "local", "path": str(model_dir), "dtype": "float32"},
        "data": {
            "sources": [
                {"name": "chats", "path": chats, "format": "auto"},
                {"name": "mtbench", "asset": "mtbench", "split": "eval", "limit": 3},
            ]
        },
        "regeneration": {"max_new_tokens": 8, "batch_size": 4, "dtype": "float32"},
        "validation": {"max_length": 256, "eval_fraction": 0.25,
                       "max_error_fraction": 0.2},  # the broken line: 1 error of the 7 items ingest takes on
        "capture": {"aux_layer_ids": [1, 2, 3], "draft_vocab_size": 128, "records_per_shard": 2},
        "training": {"ttt_length": 2, "max_steps": 3, "tokens_per_step": 256, "eval_interval": 2, "save_interval": 2},
        "evaluation": {"steps": 2, "topk": 2, "num_draft_tokens": 4, "max_new_tokens": 8},
        "deployment": {"trainer": {"nproc_per_node": 1}},
        "tracking": tracking,
    }
