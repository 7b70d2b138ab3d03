"""Tiny random targets of every family eaglet supports, built from `transformers` configs (nothing downloaded).

Each is shaped like its family where it matters to a drafter: Llama-3's long-context RoPE scaling, Qwen2.5's
q/k/v biases and tied embeddings, Qwen3's explicit head_dim and q/k norms, Qwen3-MoE's routed experts, gpt-oss's
experts, attention sinks, sliding-window layers and YaRN RoPE. Sizes stay within what vLLM's CPU attention
serves (head_dim 32). All share the ChatML tokenizer of tests/tiny_target.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NUM_LAYERS = 6
HIDDEN = 64
HEAD_DIM = 32

#: model_type -> the config fields that make the tiny target a member of its family.
FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "llama": {
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    },
    "qwen2": {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "qwen3": {"head_dim": HEAD_DIM, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "qwen3_moe": {"head_dim": HEAD_DIM, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    "gpt_oss": {"head_dim": HEAD_DIM, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 32,
                "layer_types": ["sliding_attention", "full_attention"] * (NUM_LAYERS // 2),
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}},
}
FAMILIES = tuple(FAMILY_FIELDS)


def build_family_target(model_type: str, directory: Path, seed: int = 0) -> Path:
    """Save a random `model_type` causal LM with the tiny ChatML tokenizer as an HF directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiny_target import build_tokenizer

    tokenizer = build_tokenizer()
    fields = {
        "vocab_size": len(tokenizer), "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": NUM_LAYERS, "num_attention_heads": HIDDEN // HEAD_DIM, "num_key_value_heads": 1,
        "max_position_embeddings": 512, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "tie_word_embeddings": False,
        **FAMILY_FIELDS[model_type],
    }
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
