"""Feed an eaglet draft export through SGLang's own loader (EAGLE3, or DFlash) and report what it did.

Runs inside .venv-sglang-loader (`bash tests/make_sglang_env.sh`), never in eaglet's venv, and imports nothing from
eaglet. SGLang's `LlamaForCausalLMEagle3.load_weights` skips tensor names it does not know without a word,
so "it loaded" proves nothing. This probe:

1. reads config.json with SGLang's `get_config`, resolves the dtype as `--dtype auto` would
   (`_get_and_verify_dtype`) and finds the class SGLang's registry serves `architectures[0]` with;
2. builds that model on CPU (tp=1, gloo) with every parameter set to NaN;
3. feeds our tensors one at a time through SGLang's `DefaultModelLoader.load_weights_only` (which calls
   `model.load_weights`), recording which parameter elements each tensor wrote and whether it set
   `hot_token_id`;
4. compares every parameter with what our tensors should give after SGLang's renaming (midlayer -> layers.0,
   a `model.` prefix) and stacking (q,k,v -> qkv_proj; gate,up -> gate_up_proj), checks hot_token_id,
   the RoPE buffer and the aux layers SGLang would capture in the target.

A DFlash export (architectures DFlashDraftModel, models/dflash_checkpoint.py) goes through
`sglang.srt.models.dflash.DFlashDraftModel.load_weights` the same way (steps 1-3; SGLang's renaming is only the
q,k,v and gate,up stacking), then the report says which of our tensors SGLang has no place for, which target layers
it would capture, and, with `--forward-case`, whether SGLang's own DFlash code computes what eaglet's does (the
context keys/values its worker writes, and the block's final normed states, its attention kernel replaced by SDPA
over [context; block] as its attention type says).

Prints a JSON report on stdout (a list of them for several exports; SGLang's own logs go to stderr) and
exits 1 when any report has `problems`.

    .venv-sglang-loader/bin/python tests/sglang_load_weights.py artifacts/embedded-default/draft/sglang
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import sys
import types
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

WEIGHTS = "model.safetensors"
# Where SGLang's parameters should get their values from our tensors (rows stacked in this order at tp=1).
EXPECTED_SOURCES: dict[str, list[str]] = {
    "model.fc.weight": ["fc.weight"],
    "model.layers.0.self_attn.qkv_proj.weight": [
        "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight"],
    "model.layers.0.self_attn.o_proj.weight": ["midlayer.self_attn.o_proj.weight"],
    "model.layers.0.mlp.gate_up_proj.weight": ["midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"],
    "model.layers.0.mlp.down_proj.weight": ["midlayer.mlp.down_proj.weight"],
    "model.layers.0.input_layernorm.weight": ["midlayer.input_layernorm.weight"],
    "model.layers.0.hidden_norm.weight": ["midlayer.hidden_norm.weight"],
    "model.layers.0.post_attention_layernorm.weight": ["midlayer.post_attention_layernorm.weight"],
    "model.norm.weight": ["norm.weight"],
    "lm_head.weight": ["lm_head.weight"],
}
# Parameters the export leaves out on purpose: SGLang's EAGLE worker replaces them with the target's.
FROM_TARGET = {
    "model.embed_tokens.weight": "EAGLEWorker.init_lm_head -> set_embed(target embedding), "
                                 "done only when target_hidden_size == hidden_size",
}
# What SGLang does with our tensors that are not parameters.
HOT_TOKEN_USE = "hot_token_id = d2t + arange(Vd): maps the draft's top-k ids to target ids"
SKIPPED_BY_NAME = {"t2d": "skipped by load_weights (`if 't2d' in name: continue`); SGLang only needs d2t"}


def stub_vllm_rotary_kernel() -> None:
    """SGLang's RotaryEmbedding imports `vllm._custom_ops.rotary_embedding` as a fallback forward kernel on a
    host that is neither CUDA nor its CPU engine. The probe never runs a forward, so where vllm is not
    installed a stub that refuses to be called stands in (on a CUDA host the import is never reached)."""
    if importlib.util.find_spec("vllm") is not None:
        return

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("tests/sglang_load_weights.py runs no forward pass; vllm's rotary kernel is a stub")

    package, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = refuse
    package._custom_ops = ops
    sys.modules["vllm"], sys.modules["vllm._custom_ops"] = package, ops


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def init_sglang_single_process() -> None:
    """World of one on gloo, tp=pp=ep=1: what SGLang's layer tests do (sglang.test.layer_ut_utils), inlined
    because importing sglang.test pulls its benchmark dependencies."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1), role="test", ranks=SpawnRanks(world_rank=0))
    if parallel_state._WORLD is not None:
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def resolve_dtype(hf_config: Any, requested: str) -> torch.dtype:
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    return _get_and_verify_dtype(hf_config, requested)


DFLASH_ARCHITECTURES = ("DFlashDraftModel",)


def model_class(architecture: str) -> type:
    """The class SGLang serves `architecture` with: its registry maps each model module's EntryClass by name."""
    if architecture in DFLASH_ARCHITECTURES:
        from sglang.srt.models import dflash as module
    else:
        from sglang.srt.models import llama_eagle3 as module

    classes = {cls.__name__: cls for cls in module.EntryClass}
    if architecture not in classes:
        raise SystemExit(f"config.json architectures[0] = {architecture!r} is not served by "
                         f"{module.__name__} (EntryClass: {sorted(classes)})")
    return classes[architecture]


def build_nan_model(cls: type, hf_config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """Construct as DefaultModelLoader.load_model does, then NaN every parameter so coverage can be seen."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    with set_default_torch_dtype(dtype), torch.device("cpu"):
        model = cls(config=hf_config, quant_config=None)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(math.nan)
    return model


def nan_counts(model: torch.nn.Module) -> dict[str, int]:
    return {name: int(torch.isnan(p).sum()) for name, p in model.named_parameters()}


def feed_one_by_one(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    skipped_by_name: Optional[dict[str, str]] = None) -> dict[str, dict[str, Any]]:
    """Run SGLang's loader on one tensor at a time; record what each one wrote."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    cpu = torch.device("cpu")
    tensors: dict[str, dict[str, Any]] = {}
    before = nan_counts(model)
    for name, tensor in weights:
        hot_before = getattr(model, "hot_token_id", None)
        DefaultModelLoader.load_weights_only(model, iter([(name, tensor)]), cpu)
        after = nan_counts(model)
        written = {param: before[param] - after[param] for param in after if after[param] < before[param]}
        sets_hot = getattr(model, "hot_token_id", None) is not hot_before
        tensors[name] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                         "numel": tensor.numel(),
                         "finite": bool(torch.isfinite(tensor).all()) if tensor.is_floating_point() else True,
                         "wrote": written, "set_hot_token_id": sets_hot,
                         "use": describe_use(name, written, sets_hot, skipped_by_name)}
        before = after
    DefaultModelLoader.postprocess_weights(model, cpu)
    return tensors


def describe_use(name: str, written: dict[str, int], sets_hot: bool,
                 skipped_by_name: Optional[dict[str, str]] = None) -> str:
    if written:
        return "parameter " + ", ".join(sorted(written))
    if sets_hot:
        return HOT_TOKEN_USE
    return (SKIPPED_BY_NAME if skipped_by_name is None else skipped_by_name).get(name, "IGNORED")


def parameter_report(model: torch.nn.Module, ours: dict[str, torch.Tensor], dtype: torch.dtype,
                     expected_sources: Optional[dict[str, list[str]]] = None,
                     from_target: Optional[dict[str, str]] = None) -> dict[str, dict[str, Any]]:
    """Each SGLang parameter: shape, NaNs left, and whether it equals our tensors cast to the serving dtype."""
    expected_sources = EXPECTED_SOURCES if expected_sources is None else expected_sources
    from_target = FROM_TARGET if from_target is None else from_target
    report = {}
    for name, parameter in model.named_parameters():
        entry: dict[str, Any] = {"shape": list(parameter.shape), "dtype": str(parameter.dtype).removeprefix("torch."),
                                 "nan_left": int(torch.isnan(parameter).sum()), "numel": parameter.numel(),
                                 "inf": int(torch.isinf(parameter).sum())}
        sources = expected_sources.get(name)
        if name in from_target:
            entry["from_target"] = from_target[name]
        elif sources is None:
            entry["sources"] = None
        elif all(source in ours for source in sources):
            expected = torch.cat([ours[source] for source in sources], dim=0).to(dtype)
            entry["sources"] = sources
            entry["expected_shape"] = list(expected.shape)
            same_shape = expected.shape == parameter.shape
            entry["equal"] = bool(same_shape and torch.equal(expected, parameter.detach()))
            if same_shape and not entry["equal"]:
                entry["max_abs_diff"] = float((expected.float() - parameter.detach().float()).abs().nan_to_num(math.inf).max())
        else:
            entry["sources"] = sources
            entry["missing_sources"] = [source for source in sources if source not in ours]
        report[name] = entry
    return report


def hot_token_report(model: torch.nn.Module, ours: dict[str, torch.Tensor], vocab_size: int) -> dict[str, Any]:
    """SGLang maps draft ids through hot_token_id; it must be d2t + arange and agree with our t2d."""
    hot = getattr(model, "hot_token_id", None)
    if hot is None:
        return {"present": False}
    report: dict[str, Any] = {"present": True, "shape": list(hot.shape), "dtype": str(hot.dtype).removeprefix("torch."),
                              "in_vocab": bool(((hot >= 0) & (hot < vocab_size)).all()),
                              "unique": int(hot.unique().numel()) == hot.numel()}
    if "d2t" in ours:
        d2t = ours["d2t"]
        report["equals_d2t_plus_arange"] = bool(torch.equal(hot, d2t + torch.arange(d2t.shape[0], dtype=d2t.dtype)))
    if "t2d" in ours:
        report["matches_t2d"] = bool(torch.equal(hot.sort().values, ours["t2d"].nonzero().squeeze(1)))
    return report


def rope_report(model: torch.nn.Module, config: dict[str, Any], dtype: torch.dtype,
                rotary: Optional[torch.nn.Module] = None) -> dict[str, Any]:
    """The only buffer is RoPE's cos/sin cache, computed from the config (not loaded): check SGLang read our
    rope_theta and head_dim (transformers 5 moves rope_theta into rope_parameters)."""
    rotary = model.model.layers[0].self_attn.rotary_emb if rotary is None else rotary
    report: dict[str, Any] = {"class": type(rotary).__name__, "base": float(rotary.base), "rotary_dim": rotary.rotary_dim,
                              "is_neox_style": rotary.is_neox_style,
                              "buffers": {name: list(buffer.shape) for name, buffer in model.named_buffers()}}
    report["base_matches"] = report["base"] == float(config["rope_theta"])
    report["rotary_dim_matches"] = rotary.rotary_dim == config["head_dim"]
    if config.get("rope_scaling"):
        report["cache_checked"] = False  # scaled RoPE: class and base are reported, the cache is not recomputed
        return report
    dim = config["head_dim"]
    inv_freq = 1.0 / (float(config["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    angles = torch.outer(torch.arange(rotary.cos_sin_cache.shape[0], dtype=torch.float), inv_freq)
    expected = torch.cat([angles.cos(), angles.sin()], dim=-1)
    report["cache_checked"] = True
    report["cache_matches"] = bool(torch.allclose(rotary.cos_sin_cache.float(), expected.to(dtype).float(), atol=1e-3))
    return report


def aux_layer_report(config: dict[str, Any]) -> dict[str, Any]:
    """Which target layers SGLang would capture: its model runner passes eagle_config's
    eagle_aux_hidden_state_layer_ids (or None) to the target's set_eagle3_layers_to_capture."""
    from sglang.srt.models.llama import LlamaForCausalLM

    eagle = config.get("eagle_config") or {}
    try:
        layer_ids = eagle["eagle_aux_hidden_state_layer_ids"]
    except (KeyError, TypeError):  # as spec_aux_hidden_state._resolve_eagle_aux_hidden_state
        layer_ids = None
    report: dict[str, Any] = {"eagle_aux_hidden_state_layer_ids": layer_ids,
                              "eaglet_aux_layer_ids": eagle.get("eaglet_aux_layer_ids")}
    num_layers = eagle.get("eaglet_num_target_layers")
    if num_layers is None:
        return report
    target = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True),
                                   config=types.SimpleNamespace(num_hidden_layers=num_layers),
                                   model=types.SimpleNamespace())
    LlamaForCausalLM.set_eagle3_layers_to_capture(target, layer_ids)
    # SGLang's own comment: "for the ith layer, it takes the output of the (i-1)th layer as aux hidden state".
    report["sglang_layers_to_capture"] = list(target.model.layers_to_capture)
    report["sglang_captures_outputs_of"] = [index - 1 for index in target.model.layers_to_capture]
    return report


def parameter_problems(parameters: dict[str, dict[str, Any]]) -> list[str]:
    """SGLang parameters not fully written, or not holding our values."""
    problems = []
    for name, entry in parameters.items():
        if "from_target" in entry:
            continue
        if entry["nan_left"]:
            problems.append(f"SGLang parameter {name}: {entry['nan_left']} of {entry['numel']} elements "
                            "never written by load_weights")
        if entry.get("sources") is None:
            problems.append(f"SGLang parameter {name} {entry['shape']} has no source in our export")
        elif entry.get("missing_sources"):
            problems.append(f"SGLang parameter {name}: our export lacks {entry['missing_sources']}")
        elif entry["expected_shape"] != entry["shape"]:
            problems.append(f"SGLang parameter {name}: shape {entry['shape']}, our tensors stack to {entry['expected_shape']}")
        elif not entry["equal"] and not entry["nan_left"]:
            problems.append(f"SGLang parameter {name}: values differ from ours (max abs diff {entry.get('max_abs_diff')})")
        elif entry["inf"]:
            problems.append(f"SGLang parameter {name}: {entry['inf']} values overflow {entry['dtype']}")
    return problems


def tensor_problems(tensors: dict[str, dict[str, Any]]) -> list[str]:
    """Our tensors that SGLang dropped or only partly used."""
    problems = []
    for name, entry in tensors.items():
        written = sum(entry["wrote"].values())
        if entry["use"] == "IGNORED":
            problems.append(f"our tensor {name} {entry['shape']} was ignored by SGLang's load_weights")
        elif entry["wrote"] and written != entry["numel"]:
            problems.append(f"our tensor {name}: SGLang wrote {written} new elements for its {entry['numel']}")
        if not entry["finite"]:
            problems.append(f"our tensor {name} has non-finite values")
    return problems


def serving_problems(report: dict[str, Any]) -> list[str]:
    """Token map, what SGLang takes from the target, RoPE and the captured target layers."""
    problems = []
    hot = report["hot_token_id"]
    if not hot["present"]:
        problems.append("SGLang set no hot_token_id: draft ids would be read as target ids")
    problems += [f"hot_token_id: {key} is false" for key in ("in_vocab", "unique", "equals_d2t_plus_arange", "matches_t2d")
                 if hot.get(key) is False]
    if report["load_lm_head_from_target"]:
        problems.append("SGLang will take lm_head from the target (draft_vocab_size missing): ours would be dropped")
    if not report["embed_shared_from_target"]:
        problems.append("target_hidden_size != hidden_size: SGLang keeps the draft's own embed_tokens, which we do not export")
    rope = report["rope"]
    problems += [f"RoPE: {key} is false ({rope['class']}, base {rope['base']}, dim {rope['rotary_dim']})"
                 for key in ("base_matches", "rotary_dim_matches", "cache_matches") if rope.get(key) is False]
    aux = report["aux_layers"]
    captured, trained = aux.get("sglang_captures_outputs_of"), aux.get("eaglet_aux_layer_ids")
    if captured is not None and trained is not None and captured != trained:
        problems.append(f"SGLang would capture the outputs of target layers {captured}, the draft was trained on {trained}")
    return problems


def problems_of(report: dict[str, Any]) -> list[str]:
    """Everything that would make SGLang serve something other than our draft."""
    return parameter_problems(report["parameters"]) + tensor_problems(report["tensors"]) + serving_problems(report)


# DFlash: sglang.srt.models.dflash.DFlashDraftModel and its DFLASH worker (sglang/srt/speculative/dflash_worker_v2.py).
#: SGLang's fused parameters and the checkpoint names its load_weights stacks into them, in row order at tp=1.
DFLASH_STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
#: Our DFlash tensors SGLang's DFlashDraftModel has no parameter for (its load_weights drops unknown names without a
#: word), and what SGLang does instead.
DFLASH_NO_PLACE = {
    "lm_head.weight": "DFlashDraftModel has no lm_head: the DFLASH worker drafts with the target's lm_head "
                      "(full vocabulary, greedy argmax) on the draft's normed states",
    "d2t": "no draft vocabulary in SGLang's DFLASH (no hot_token_id): the target's lm_head gives target ids",
    "t2d": "no draft vocabulary in SGLang's DFLASH",
}


def dflash_expected_sources(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each SGLang DFlash parameter and the tensors of our export that must fill it: the same name, except
    qkv_proj <- q_proj, k_proj, v_proj and gate_up_proj <- gate_proj, up_proj (DFlashDraftModel.load_weights)."""
    sources: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        for stacked, parts in DFLASH_STACKED.items():
            if f".{stacked}." in name:
                sources[name] = [name.replace(stacked, part) for part in parts]
                break
        else:
            sources[name] = [name]
    return sources


def dflash_structure_report(model: torch.nn.Module, hf_config: Any) -> dict[str, Any]:
    """What SGLang built from our config.json: context width, block size, mask token, attention type per layer,
    and which target layers it would capture."""
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    draft = parse_dflash_draft_config(draft_hf_config=hf_config)
    # model_runner's spec_aux_hidden_state resolves the ids against the runtime target's depth (explicit ids are only
    # range-checked) and hands them to the target's set_dflash_layers_to_capture.
    depth = max(draft.target_layer_ids or [0]) + 1
    layer_ids = draft.resolve_target_layer_ids(target_num_layers=depth, draft_num_layers=draft.require_num_layers())
    captures = {}
    for target_cls in (LlamaForCausalLM, Qwen3ForCausalLM):
        target = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True), model=types.SimpleNamespace())
        target_cls.set_dflash_layers_to_capture(target, layer_ids)
        captures[target_cls.__name__] = list(target.model.layers_to_capture)
    first = next(iter(captures.values()))
    return {
        "num_layers": len(model.layers), "block_size": model.block_size, "mask_token_id": draft.mask_token_id,
        "target_layer_ids": layer_ids, "num_context_features": model.num_context_features,
        "fc_shape": list(model.fc.weight.shape),
        "attention_types": [layer.self_attn.attn.attn_type.name for layer in model.layers],
        "sliding_windows": [layer.self_attn.sliding_window_size for layer in model.layers],
        "has_lm_head": any(name.startswith("lm_head") for name, _ in model.named_parameters()),
        "has_embed_tokens": model.embed_tokens is not None,
        "hot_token_id": getattr(model, "hot_token_id", None) is not None,
        # DFlashDraftModel's prepare_context_hidden_for_kv returns the projected context as it is (Laguna's norms it).
        "context_kv_input": ("hidden_norm(fc(aux))" if type(model).prepare_context_hidden_for_kv
                             is DFlashDraftModel.prepare_context_hidden_for_kv else type(model).__name__),
        "layers_to_capture": captures,
        "sglang_captures_outputs_of": [index - 1 for index in first],
    }


class SdpaForRadixAttention(torch.nn.Module):
    """Stands in for one layer's RadixAttention (a KV-cache kernel that needs a GPU batch): the block's queries
    attend to this layer's context keys/values, as the worker wrote them to the draft cache, then to the block's own
    keys/values, over the whole block (ENCODER_ONLY, DFlash's default) or causally within it (DECODER)."""

    def __init__(self, radix: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        from sglang.srt.layers.radix_attention import AttentionType

        self.heads, self.kv_heads, self.head_dim = radix.tp_q_head_num, radix.tp_k_head_num, radix.head_dim
        self.scaling, self.causal = radix.scaling, radix.attn_type == AttentionType.DECODER
        if radix.sliding_window_size not in (None, -1):
            raise NotImplementedError("sliding-window DFlash layers are not probed")
        self.keys, self.values = keys, values  # [S, kv_heads, head_dim]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: Any = None,
                **_: Any) -> torch.Tensor:
        length, context = q.shape[0], self.keys.shape[0]
        queries = q.view(length, self.heads, self.head_dim).transpose(0, 1)
        keys = torch.cat([self.keys, k.view(length, self.kv_heads, self.head_dim)]).transpose(0, 1)
        values = torch.cat([self.values, v.view(length, self.kv_heads, self.head_dim)]).transpose(0, 1)
        groups = self.heads // self.kv_heads
        visible = torch.ones(length, context + length, dtype=torch.bool)
        if self.causal:
            visible[:, context:] = torch.ones(length, length, dtype=torch.bool).tril()
        out = torch.nn.functional.scaled_dot_product_attention(
            queries, keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0), attn_mask=visible,
            scale=self.scaling)
        return out.transpose(0, 1).reshape(length, self.heads * self.head_dim)


def dflash_forward_report(cls: type, hf_config: Any, export: Path, case_path: Path) -> dict[str, Any]:
    """Run SGLang's own DFlash code (float32, every weight loaded by its load_weights) on the case's inputs and
    compare with eaglet's outputs stored in the case.

    Context: what the DFLASH worker writes to the draft KV cache for committed tokens
    (`_append_target_hidden_sequential`): project_target_hidden (fc, then hidden_norm), prepare_context_hidden_for_kv,
    kv_proj_only, apply_k_norm, apply_k_rope. Block: DFlashDraftModel.forward on the block's input embeddings
    (the worker embeds [token, MASK...] with the target's embedding), each layer's RadixAttention replaced by
    SdpaForRadixAttention over that layer's context; its output is the final normed state SGLang feeds to the
    target's lm_head.

    Case tensors (float32 unless said): aux [S, 3H], context_positions [S] int64, block_embeds [Q, H],
    block_positions [Q] int64, eaglet.context.{i}.keys / .values [kv_heads, S, head_dim] (normed, rotated keys),
    eaglet.block_normed [Q, H] (norm of the last layer's output)."""
    from safetensors.torch import load_file
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    cpu = torch.device("cpu")
    model = build_nan_model(cls, hf_config, torch.float32)
    DefaultModelLoader.load_weights_only(model, safetensors_weights_iterator([str(export / WEIGHTS)]), cpu)
    DefaultModelLoader.postprocess_weights(model, cpu)
    case = load_file(str(case_path))
    report: dict[str, Any] = {"case": str(case_path), "context": {}}

    def diff(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, Any]:
        same = ours.shape == theirs.shape
        gap = (ours - theirs).abs().nan_to_num(math.inf).max() if same else None  # a weight never loaded: inf
        return {"shape": list(theirs.shape), "expected_shape": list(ours.shape),
                "max_abs_diff": None if gap is None else float(gap), "max_abs": float(ours.abs().max())}

    with torch.no_grad():
        positions = case["context_positions"]
        ctx_hidden = model.project_target_hidden(case["aux"])
        contexts = []
        for index, layer in enumerate(model.layers):
            attn = layer.self_attn
            k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, ctx_hidden))
            k = attn.apply_k_rope(positions, attn.apply_k_norm(k))
            k = k.view(-1, attn.num_kv_heads, attn.head_dim)
            v = v.view(-1, attn.num_kv_heads, attn.head_dim)
            contexts.append((k, v))
            report["context"][f"layers.{index}"] = {
                "keys": diff(case[f"eaglet.context.{index}.keys"], k.transpose(0, 1)),
                "values": diff(case[f"eaglet.context.{index}.values"], v.transpose(0, 1))}
        for layer, (k, v) in zip(model.layers, contexts):
            layer.self_attn.attn = SdpaForRadixAttention(layer.self_attn.attn, k, v)
        embeds = case["block_embeds"]
        ids = torch.zeros(embeds.shape[0], dtype=torch.long)  # unused: input_embeds is given, as by the worker
        output = model.forward(ids, case["block_positions"], None, input_embeds=embeds)
        report["block_normed"] = diff(case["eaglet.block_normed"], output.hidden_states)
    return report


def dflash_serving_problems(report: dict[str, Any]) -> list[str]:
    """What SGLang's DFLASH would serve differently from our draft."""
    problems = []
    structure = report["structure"]
    if not structure["has_lm_head"]:
        problems.append("SGLang's DFlash draft has no lm_head: it drafts with the target's lm_head over the full "
                        "vocabulary, not with our trained draft-vocabulary lm_head (lm_head.weight, d2t, t2d unused)")
    if structure["sglang_captures_outputs_of"] != structure["target_layer_ids"]:
        problems.append(f"SGLang would capture the outputs of target layers {structure['sglang_captures_outputs_of']}, "
                        f"our dflash_config.target_layer_ids are {structure['target_layer_ids']}")
    rope = report["rope"]
    problems += [f"RoPE: {key} is false ({rope['class']}, base {rope['base']}, dim {rope['rotary_dim']})"
                 for key in ("base_matches", "rotary_dim_matches", "cache_matches") if rope.get(key) is False]
    forward = report.get("forward")
    if forward is not None:
        checks = {f"context {layer} {part}": entry for layer, parts in forward["context"].items()
                  for part, entry in parts.items()}
        checks["block normed states"] = forward["block_normed"]
        for what, entry in checks.items():
            if entry["max_abs_diff"] is None:
                problems.append(f"{what}: SGLang's shape {entry['shape']}, eaglet's {entry['expected_shape']}")
            elif not entry["max_abs_diff"] <= 1e-4 * max(1.0, entry["max_abs"]):
                problems.append(f"{what}: SGLang computes something else than eaglet "
                                f"(max abs diff {entry['max_abs_diff']})")
    return problems


def probe_dflash(export: Path, requested_dtype: str, forward_case: Optional[Path]) -> dict[str, Any]:
    """probe() for a DFlash export: SGLang's DFlashDraftModel."""
    import sglang
    import transformers
    from safetensors.torch import load_file
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.utils.hf_transformers.config import get_config

    config = json.loads((export / "config.json").read_text())
    hf_config = get_config(str(export), trust_remote_code=False)
    dtype = resolve_dtype(hf_config, requested_dtype)
    cls = model_class(hf_config.architectures[0])
    model = build_nan_model(cls, hf_config, dtype)
    tensors = feed_one_by_one(model, safetensors_weights_iterator([str(export / WEIGHTS)]), skipped_by_name={})
    for name, entry in tensors.items():
        if entry["use"] == "IGNORED" and name in DFLASH_NO_PLACE:
            entry["why"] = DFLASH_NO_PLACE[name]
    ours = load_file(str(export / WEIGHTS))
    report: dict[str, Any] = {
        **report_head(export, cls, hf_config, requested_dtype, dtype, config),
        "parameters": parameter_report(model, ours, dtype, dflash_expected_sources(model), {}),
        "tensors": tensors,
        "hot_token_id": hot_token_report(model, ours, hf_config.vocab_size),
        "structure": dflash_structure_report(model, hf_config),
        "rope": rope_report(model, config, dtype, model.layers[0].self_attn.rotary_emb),
    }
    if forward_case is not None:
        report["forward"] = dflash_forward_report(cls, hf_config, export, forward_case)
    report["problems"] = (parameter_problems(report["parameters"]) + tensor_problems(report["tensors"])
                          + dflash_serving_problems(report))
    return report


def report_head(export: Path, cls: Any, hf_config: Any, requested_dtype: str, dtype: Any,
                config: dict[str, Any]) -> dict[str, Any]:
    """What every probe report starts with: the export, the versions, SGLang's model class and the dtypes."""
    import sglang
    import transformers

    return {
        "export": str(export), "versions": {"sglang": sglang.__version__, "torch": torch.__version__,
                                            "transformers": transformers.__version__},
        "model_class": f"{cls.__module__}.{cls.__qualname__}", "config_class": type(hf_config).__name__,
        "dtype": {"requested": requested_dtype, "resolved": str(dtype).removeprefix("torch."),
                  "config": config.get("torch_dtype")},
    }


def start_sglang() -> None:
    """Once per process: the stub, then SGLang's parallel state."""
    stub_vllm_rotary_kernel()
    init_sglang_single_process()


def probe(export: Path, requested_dtype: str, forward_case: Optional[Path] = None) -> dict[str, Any]:
    """Load one export the way SGLang does and describe the result (start_sglang() first)."""
    config = json.loads((export / "config.json").read_text())
    if (config.get("architectures") or [None])[0] in DFLASH_ARCHITECTURES:
        return probe_dflash(export, requested_dtype, forward_case)
    import sglang
    import transformers
    from safetensors.torch import load_file
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.utils.hf_transformers.config import get_config

    config = json.loads((export / "config.json").read_text())
    hf_config = get_config(str(export), trust_remote_code=False)
    dtype = resolve_dtype(hf_config, requested_dtype)
    cls = model_class(hf_config.architectures[0])
    model = build_nan_model(cls, hf_config, dtype)
    tensors = feed_one_by_one(model, safetensors_weights_iterator([str(export / WEIGHTS)]))
    ours = load_file(str(export / WEIGHTS))
    report: dict[str, Any] = {
        **report_head(export, cls, hf_config, requested_dtype, dtype, config),
        "load_lm_head_from_target": bool(model.load_lm_head_from_target),
        "embed_shared_from_target": getattr(hf_config, "target_hidden_size", hf_config.hidden_size) == hf_config.hidden_size,
        "parameters": parameter_report(model, ours, dtype),
        "tensors": tensors,
        "hot_token_id": hot_token_report(model, ours, hf_config.vocab_size),
        "rope": rope_report(model, config, dtype),
        "aux_layers": aux_layer_report(config),
    }
    report["problems"] = problems_of(report)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", type=Path, nargs="+",
                        help="eaglet draft exports for SGLang (config.json + model.safetensors); several share one start-up")
    parser.add_argument("--dtype", default="auto", help="as SGLang's --dtype (auto: float16 for a float32 checkpoint)")
    parser.add_argument("--forward-case", type=Path, default=None,
                        help="DFlash exports: a safetensors file of inputs and eaglet's outputs "
                             "(dflash_forward_report)")
    args = parser.parse_args(argv)
    start_sglang()
    reports = [probe(export.resolve(), args.dtype, args.forward_case) for export in args.exports]
    print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
    return 1 if any(report["problems"] for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
