"""The contract that travels with every draft checkpoint (docs/architecture.md §5), and the check a target must pass.

A drafter is only useful for the exact target, tokenizer and chat template it was trained against; loading
it anywhere else must fail loudly, naming the field that differs.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

AUX_CONVENTION = "output of decoder layer i (0-indexed) = HF output_hidden_states[i + 1]"
# The engines a drafter is exported for (draft/<engine>/), and the files of one export.
ENGINES = ("sglang", "vllm")
EXPORT_FILES = ("config.json", "model.safetensors", "contract.json")


class CheckpointContract(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = 1
    target_id: str
    target_revision: str
    tokenizer_hash: str
    chat_template_hash: Optional[str]
    chat_template: Optional[str] = None
    reasoning_mode: str = "off"
    reasoning_parser: str = "think-tags"
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="the template variables training "
                                                 "rendered with; serve with the same (chat_template_kwargs)")
    method: str = Field(default="eagle3", description="the draft method (draft.method): eagle3 or eagle3.1")
    draft_config: dict[str, Any]
    aux_layer_ids: list[int]
    aux_convention: str = AUX_CONVENTION
    fusion_dims: list[int] = Field(description="[fc input width, fc output width]")
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    vocab_mapping_hash: Optional[str] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int | list[int]] = None
    pad_token_id: Optional[int] = None
    training: dict[str, Any] = Field(default_factory=dict)
    versions: dict[str, str] = Field(default_factory=dict)
    data: dict[str, Any] = Field(default_factory=dict)
    evaluation: dict[str, Any] = Field(default_factory=dict)
    engine: Optional[str] = None


class ContractMismatch(ValueError):
    """A checkpoint that does not belong to the target it is loaded for."""


def check_against_target(contract: CheckpointContract, target_info: dict[str, Any]) -> None:
    """Compare the contract with a target's `target.json`; raise naming every field that differs."""
    expected = {
        "hidden_size": target_info.get("hidden_size"),
        "vocab_size": target_info.get("vocab_size"),
        "bos_token_id": target_info.get("bos_token_id"),
        "eos_token_id": target_info.get("eos_token_id"),
        "pad_token_id": target_info.get("pad_token_id"),
        "tokenizer_hash": target_info.get("tokenizer_hash"),
        "target_revision": target_info.get("revision"),
    }
    problems = [
        f"{name}: checkpoint has {getattr(contract, name)!r}, target has {value!r}"
        for name, value in expected.items()
        if getattr(contract, name) != value
    ]
    if problems:
        raise ContractMismatch("draft checkpoint does not match the target:\n  - " + "\n  - ".join(problems))
