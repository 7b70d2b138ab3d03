"""The target families eaglet drafts for, one row each: where capture finds the decoder layers and the final norm,
what the weights offline training reads are called, and how wide the draft's (always dense) MLP is.

Capture (models/target_capture.py), the target heads (models/target_heads.py), the draft config
(models/eagle3.py `Eagle3Config.from_target`) and `eaglet config validate` (flows/preflight.py) read this table and
nothing else, so a new family is one row here plus a tiny target in tests/tiny_families.py. A target whose
`model_type` has no row fails naming it and the supported list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


class UnsupportedArchitecture(ValueError):
    """The target's model_type has no row in FAMILIES."""


def dense_width(text_config: Any) -> int:
    """A dense target's MLP width: the draft's MLP has the same."""
    return int(text_config.intermediate_size)


def active_experts_width(per_expert: str) -> Callable[[Any], int]:
    """A routed-expert target: the draft's dense MLP is as wide as the experts one token passes through
    (experts per token x one expert's width), so it costs what the target's MLP costs per token."""

    def width(text_config: Any) -> int:
        return int(text_config.num_experts_per_tok) * int(getattr(text_config, per_expert))

    return width


@dataclass(frozen=True)
class TargetFamily:
    """How eaglet reads one architecture family (paths from the *ForCausalLM, tensor names in its safetensors)."""

    model_type: str
    label: str
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    embedding_weight: str = "model.embed_tokens.weight"
    lm_head_weight: str = "lm_head.weight"
    final_norm_weight: str = "model.norm.weight"
    draft_intermediate_size: Callable[[Any], int] = dense_width


FAMILIES: dict[str, TargetFamily] = {
    family.model_type: family for family in (
        TargetFamily("llama", "Llama 2/3.x (RoPE scaling llama3), SmolLM2"),
        TargetFamily("qwen2", "Qwen2 / Qwen2.5"),
        TargetFamily("qwen3", "Qwen3 (dense)"),
        TargetFamily("qwen3_moe", "Qwen3-MoE", draft_intermediate_size=active_experts_width("moe_intermediate_size")),
        TargetFamily("gpt_oss", "gpt-oss", draft_intermediate_size=active_experts_width("intermediate_size")),
    )
}


def supported_list() -> str:
    return ", ".join(FAMILIES)


def family_of(model_type: str | None) -> TargetFamily:
    """The row of `model_type`; an architecture without one fails naming it and what is supported."""
    if model_type not in FAMILIES:
        raise UnsupportedArchitecture(f"target architecture (model_type) '{model_type}' is not supported: eaglet knows "
                                      f"where the decoder layers and final norm are for {supported_list()}")
    return FAMILIES[model_type]


def text_config_of(config: Any) -> Any:
    """The language model's config (a multimodal config nests it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def family_of_model(model: Any) -> TargetFamily:
    return family_of(getattr(text_config_of(model.config), "model_type", None))


def submodule(model: Any, path: str) -> Any:
    """`model.<path>` (dotted), or None where an attribute is missing."""
    current = model
    for name in path.split("."):
        current = getattr(current, name, None)
        if current is None:
            return None
    return current
