"""Feed an eaglet `sglang` draft export through SGLang's own EAGLE3 loader and report what it did.

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


def model_class(architecture: str) -> type:
    """The class SGLang serves `architecture` with: its registry maps each model module's EntryClass by name."""
    from sglang.srt.models import llama_eagle3

    classes = {cls.__name__: cls for cls in llama_eagle3.EntryClass}
    if architecture not in classes:
        raise SystemExit(f"config.json architectures[0] = {architecture!r} is not served by "
                         f"sglang.srt.models.llama_eagle3 (EntryClass: {sorted(classes)})")
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


def feed_one_by_one(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
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
                         "use": describe_use(name, written, sets_hot)}
        before = after
    DefaultModelLoader.postprocess_weights(model, cpu)
    return tensors


def describe_use(name: str, written: dict[str, int], sets_hot: bool) -> str:
    if written:
        return "parameter " + ", ".join(sorted(written))
    if sets_hot:
        return HOT_TOKEN_USE
    return SKIPPED_BY_NAME.get(name, "IGNORED")


def parameter_report(model: torch.nn.Module, ours: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, dict[str, Any]]:
    """Each SGLang parameter: shape, NaNs left, and whether it equals our tensors cast to the serving dtype."""
    report = {}
    for name, parameter in model.named_parameters():
        entry: dict[str, Any] = {"shape": list(parameter.shape), "dtype": str(parameter.dtype).removeprefix("torch."),
                                 "nan_left": int(torch.isnan(parameter).sum()), "numel": parameter.numel(),
                                 "inf": int(torch.isinf(parameter).sum())}
        sources = EXPECTED_SOURCES.get(name)
        if name in FROM_TARGET:
            entry["from_target"] = FROM_TARGET[name]
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


def rope_report(model: torch.nn.Module, config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """The only buffer is RoPE's cos/sin cache, computed from the config (not loaded): check SGLang read our
    rope_theta and head_dim (transformers 5 moves rope_theta into rope_parameters)."""
    rotary = model.model.layers[0].self_attn.rotary_emb
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


def start_sglang() -> None:
    """Once per process: the stub, then SGLang's parallel state."""
    stub_vllm_rotary_kernel()
    init_sglang_single_process()


def probe(export: Path, requested_dtype: str) -> dict[str, Any]:
    """Load one export the way SGLang does and describe the result (start_sglang() first)."""
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
        "export": str(export), "versions": {"sglang": sglang.__version__, "torch": torch.__version__,
                                            "transformers": transformers.__version__},
        "model_class": f"{cls.__module__}.{cls.__qualname__}", "config_class": type(hf_config).__name__,
        "dtype": {"requested": requested_dtype, "resolved": str(dtype).removeprefix("torch."),
                  "config": config.get("torch_dtype")},
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
    args = parser.parse_args(argv)
    start_sglang()
    reports = [probe(export.resolve(), args.dtype) for export in args.exports]
    print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
    return 1 if any(report["problems"] for report in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
