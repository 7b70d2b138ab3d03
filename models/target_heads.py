"""The only target weights offline training needs: token embedding, lm_head and final norm.

Read by tensor name straight from the target's safetensors, so an 8B target never has to be loaded
whole to train its drafter offline. A target with tied embeddings uses the embedding as lm_head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


@dataclass
class TargetHeads:
    embedding: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor

    def to(self, device: torch.device) -> "TargetHeads":
        return TargetHeads(self.embedding.to(device), self.lm_head.to(device), self.final_norm.to(device))


def tensor_locations(directory: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the shard index or the single file."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    with safe_open(str(single), "pt") as handle:
        return {name: single for name in handle.keys()}


def read_tensor(locations: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(locations[name]), "pt") as handle:
        return handle.get_tensor(name).float()


def load_target_heads(directory: Path) -> TargetHeads:
    locations = tensor_locations(directory)
    missing = [name for name in (EMBEDDING, FINAL_NORM) if name not in locations]
    if missing:
        raise KeyError(f"{directory}: target weights lack {missing}; only Llama-style targets are supported")
    embedding = read_tensor(locations, EMBEDDING)
    lm_head = read_tensor(locations, LM_HEAD) if LM_HEAD in locations else embedding
    return TargetHeads(embedding, lm_head, read_tensor(locations, FINAL_NORM))
