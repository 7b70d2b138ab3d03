"""The DFlash export in the layout vLLM's dflash method loads (architecture DFlashDraftModel, Qwen3-style names).

config.json: the Qwen3 fields of the draft, `block_size`, and `dflash_config` with `mask_token_id` and
`target_layer_ids` (the outputs of those target decoder layers, 0-indexed: eaglet's aux layer ids as they are; vLLM
adds one to reach its own numbering of the states entering a layer), plus eaglet's own keys there (`eaglet_*`).
model.safetensors: fc, hidden_norm, layers.{i}.* (q/k/v/o, q_norm, k_norm, input/post-attention norms, MLP), norm,
lm_head over the draft vocabulary, d2t, t2d; never embed_tokens (vLLM takes the target's).
"""

from __future__ import annotations

from typing import Any

from models.dflash import DFlashConfig

ARCHITECTURE = "DFlashDraftModel"
LAYER_TENSORS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


def dflash_tensor_names(config: DFlashConfig) -> tuple[str, ...]:
    layers = tuple(f"layers.{index}.{name}" for index in range(config.num_layers) for name in LAYER_TENSORS)
    return ("fc.weight", "hidden_norm.weight", *layers, "norm.weight", "lm_head.weight", "d2t", "t2d")


def dflash_hf_config(config: DFlashConfig) -> dict[str, Any]:
    """config.json of a DFlash export (the same for every engine: only vLLM serves it)."""
    result: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "num_hidden_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "block_size": config.block_size,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.aux_layer_ids),
                          "eaglet_anchors": config.anchors},
    }
    if config.rope_scaling:
        result["rope_scaling"] = config.rope_scaling
    return result


def dflash_config_from_hf(config: dict[str, Any]) -> DFlashConfig:
    dflash = config["dflash_config"]
    return DFlashConfig(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"], vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
        aux_layer_ids=list(dflash["target_layer_ids"]), rope_scaling=config.get("rope_scaling"),
        bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"),
        pad_token_id=config.get("pad_token_id"), hidden_act=config.get("hidden_act", "silu"),
        mask_token_id=dflash["mask_token_id"], num_layers=config["num_hidden_layers"],
        block_size=config["block_size"], anchors=dflash.get("eaglet_anchors", 512),
    )


def dflash_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[str, list[int]]]:
    """Name -> (dtype kind, shape) of every tensor of a DFlash export, from its config.json. vLLM loads an export
    with a tensor missing without a word (an uninitialised weight, a norm of ones), so the doctor counts them."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    target_hidden = config.get("target_hidden_size") or hidden
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    aux_count = len(config["dflash_config"]["target_layer_ids"])
    per_layer = {
        "self_attn.q_proj.weight": [heads * head_dim, hidden], "self_attn.k_proj.weight": [kv_heads * head_dim, hidden],
        "self_attn.v_proj.weight": [kv_heads * head_dim, hidden], "self_attn.o_proj.weight": [hidden, heads * head_dim],
        "self_attn.q_norm.weight": [head_dim], "self_attn.k_norm.weight": [head_dim],
        "input_layernorm.weight": [hidden], "post_attention_layernorm.weight": [hidden],
        "mlp.gate_proj.weight": [inner, hidden], "mlp.up_proj.weight": [inner, hidden],
        "mlp.down_proj.weight": [hidden, inner],
    }
    shapes: dict[str, tuple[str, list[int]]] = {"fc.weight": ("float", [hidden, aux_count * target_hidden]),
                                                "hidden_norm.weight": ("float", [hidden])}
    for index in range(config["num_hidden_layers"]):
        shapes.update({f"layers.{index}.{name}": ("float", shape) for name, shape in per_layer.items()})
    shapes.update({"norm.weight": ("float", [hidden]),
                   "lm_head.weight": ("float", [config["draft_vocab_size"], hidden]),
                   "d2t": ("int64", [config["draft_vocab_size"]]), "t2d": ("bool", [config["vocab_size"]])})
    return shapes


def is_dflash_export(config: dict[str, Any]) -> bool:
    return config.get("architectures") == [ARCHITECTURE]
