"""Saving and loading the draft in the community EAGLE3 format that SGLang, vLLM and SpecForge load.

`config.json` (architectures LlamaForCausalLMEagle3, one hidden layer, draft_vocab_size, eagle_config) +
`model.safetensors` (fc, midlayer.*, norm, lm_head, d2t, t2d; never embed_tokens) + `contract.json`. A DFlash draft
is written in vLLM's DFlashDraftModel layout instead (models/dflash_checkpoint.py). EAGLE 3.1 adds
`fc_norm.{0,1,2}.weight` and the config flags `fc_norm` and `norm_output`, which vLLM's llama_eagle3.py reads.
P-EAGLE adds `mask_hidden` [1, 3H] and the config's `mask_token_id` (vLLM's parallel drafting reads both; it refuses
to start without `mask_hidden`), and marks itself in eagle_config (`eaglet_parallel_drafting`), from which it loads
back as P-EAGLE; the engine command adds `parallel_drafting` from the export's contract (tasks/serving/serving_setting.py).

The engines read `eagle_config.eagle_aux_hidden_state_layer_ids` differently (docs/architecture.md §3): SGLang captures
the output of layer id, vLLM the output of layer id - 1. Our ids mean "output of layer i", so the SGLang
export writes them as they are, the vLLM export writes i + 1, and both omit the field when the ids are
the defaults [1, N//2 - 1, N - 4], which the engines agree on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from contract.checkpoint import ENGINES, CheckpointContract, check_against_target
from models.dflash import DFlashConfig
from models.dflash_checkpoint import ARCHITECTURE as DFLASH_ARCHITECTURE
from models.dflash_checkpoint import dflash_config_from_hf, dflash_hf_config, dflash_tensor_names
from models.draft_methods import DraftModel, new_draft
from models.eagle3 import Eagle3Config
from models.target_capture import default_aux_layer_ids, vllm_layer_id

WEIGHTS = "model.safetensors"
EXPECTED_TENSORS = (
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
)
#: EAGLE 3.1's per-aux-state norms before fc (config `fc_norm`).
FC_NORM_TENSORS = ("fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight")
#: P-EAGLE's learned input state of the masked slots (config `parallel_drafting`).
MASK_TENSORS = ("mask_hidden",)


def expected_tensor_names(config: Eagle3Config) -> tuple[str, ...]:
    """The tensors a draft of this config saves: EXPECTED_TENSORS, fc_norm's for EAGLE 3.1, mask_hidden for P-EAGLE."""
    return (EXPECTED_TENSORS + (FC_NORM_TENSORS if config.fc_norm else ())
            + (MASK_TENSORS if config.parallel_drafting else ()))


def engine_layer_ids(aux_layer_ids: list[int], num_target_layers: int, engine: Optional[str]) -> Optional[list[int]]:
    """What to write in eagle_config for an engine (None: omit the field, the engine's default is ours)."""
    if aux_layer_ids == default_aux_layer_ids(num_target_layers):
        return None
    if engine == "vllm":
        return [vllm_layer_id(layer) for layer in aux_layer_ids]
    return list(aux_layer_ids)


def hf_config(config: Eagle3Config, num_target_layers: int, engine: Optional[str]) -> dict[str, Any]:
    """config.json as the engines expect it."""
    eagle_config: dict[str, Any] = {"use_aux_hidden_state": True, "eaglet_aux_layer_ids": config.aux_layer_ids,
                                    "eaglet_num_target_layers": num_target_layers}
    layer_ids = engine_layer_ids(config.aux_layer_ids, num_target_layers, engine)
    if layer_ids is not None:
        eagle_config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    result: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
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
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": eagle_config,
    }
    if config.rope_scaling:
        result["rope_scaling"] = config.rope_scaling
    if config.fc_norm:
        result["fc_norm"] = True
    if config.norm_output:
        result["norm_output"] = True
    if config.parallel_drafting:
        eagle_config["eaglet_parallel_drafting"] = True
        result["mask_token_id"] = config.mask_token_id
    return result


def config_json(config: Eagle3Config, num_target_layers: int, engine: Optional[str]) -> dict[str, Any]:
    """config.json of a draft of any method (DFlash's: models/dflash_checkpoint.py)."""
    if isinstance(config, DFlashConfig):
        return dflash_hf_config(config)
    return hf_config(config, num_target_layers, engine)


def save_pretrained(draft: DraftModel, directory: Path, contract: CheckpointContract, num_target_layers: int,
                    engine: Optional[str] = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json, model.safetensors (no embed_tokens) and contract.json into `directory`."""
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in draft.state_dict().items():
        value = tensor.detach().cpu().contiguous()
        tensors[name] = value.to(dtype) if value.is_floating_point() else value
    save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
    config = config_json(draft.config, num_target_layers, engine)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    exported = contract.model_copy(update={"engine": engine, "draft_config": draft.config.to_dict()})
    (directory / "contract.json").write_text(exported.model_dump_json(indent=2) + "\n")
    return directory


def config_from_hf(config: dict[str, Any]) -> Eagle3Config:
    """Rebuild the draft config from config.json (our own eagle_config keys carry the layer ids)."""
    eagle = config.get("eagle_config", {})
    return Eagle3Config(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"], vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"], target_hidden_size=config.get("target_hidden_size", config["hidden_size"]),
        aux_layer_ids=eagle.get("eaglet_aux_layer_ids", []), rope_scaling=config.get("rope_scaling"),
        bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"),
        pad_token_id=config.get("pad_token_id"), hidden_act=config.get("hidden_act", "silu"),
        fc_norm=bool(config.get("fc_norm", False)), norm_output=bool(config.get("norm_output", False)),
        parallel_drafting=bool(eagle.get("eaglet_parallel_drafting", False)),
        mask_token_id=config.get("mask_token_id"),
    )



def any_config_from_hf(config: dict[str, Any]) -> Eagle3Config:
    """The draft config of a config.json of any method."""
    if config.get("architectures") == [DFLASH_ARCHITECTURE]:
        return dflash_config_from_hf(config)
    return config_from_hf(config)


def tensor_names(config: Eagle3Config) -> tuple[str, ...]:
    """The tensors a draft of any method saves."""
    if isinstance(config, DFlashConfig):
        return dflash_tensor_names(config)
    return expected_tensor_names(config)


def load_pretrained(directory: Path, target_info: Optional[dict[str, Any]] = None) -> tuple[DraftModel, CheckpointContract]:
    """Load a saved draft (fp32); with `target_info` (target.json) refuse a checkpoint of another target."""
    config = json.loads((directory / "config.json").read_text())
    contract = CheckpointContract.model_validate_json((directory / "contract.json").read_text())
    if target_info is not None:
        check_against_target(contract, target_info)
    tensors = load_file(str(directory / WEIGHTS))
    draft_config = any_config_from_hf(config)
    expected = tensor_names(draft_config)
    missing = [name for name in expected if name not in tensors]
    unknown = [name for name in tensors if name not in expected]
    if missing or unknown:
        raise ValueError(f"{directory / WEIGHTS}: missing tensors {missing}, unexpected tensors {unknown} "
                         f"(config.json says method {draft_config.method})")
    draft = new_draft(draft_config)
    draft.load_state_dict({name: value.float() if value.is_floating_point() else value for name, value in tensors.items()})
    return draft, contract
