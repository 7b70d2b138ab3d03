"""The only target weights offline training needs: token embedding, lm_head and final norm.

Read by tensor name straight from the target's safetensors, so an 8B target never has to be loaded
whole to train its drafter offline; the names are its family's (models/target_families.py). A target with tied
embeddings uses the embedding as lm_head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from models.target_families import TargetFamily, family_of



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


def target_family(directory: Path) -> TargetFamily:
    """The family row of the target saved in `directory` (its config.json's model_type)."""
    return family_of(json.loads((directory / "config.json").read_text()).get("model_type"))


def load_target_heads(directory: Path) -> TargetHeads:
    family = target_family(directory)
    locations = tensor_locations(directory)
    missing = [name for name in (family.embedding_weight, family.final_norm_weight) if name not in locations]
    if missing:
        raise KeyError(f"{directory}: the {family.model_type} target's weights lack {missing}")
    embedding = read_tensor(locations, family.embedding_weight)
    lm_head = read_tensor(locations, family.lm_head_weight) if family.lm_head_weight in locations else embedding
    return TargetHeads(embedding, lm_head, read_tensor(locations, family.final_norm_weight))
