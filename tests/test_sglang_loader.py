"""Our `sglang` draft export through SGLang's own loader (`LlamaForCausalLMEagle3.load_weights`).

SGLang drops tensor names it does not know without a word, so these tests run tests/sglang_load_weights.py in
SGLang's own environment (.venv-sglang-loader): every SGLang parameter must be written, with our values after its
renaming and q/k/v, gate/up stacking; none of our tensors may be ignored; d2t must become hot_token_id.
A deliberately broken export shows the probe sees what SGLang skips silently.

Our DFlash export (models/dflash_checkpoint.py) goes through SGLang 0.5.23's `DFlashDraftModel.load_weights`
(sglang/srt/models/dflash.py) the same way. SGLang's DFlash draft has no lm_head, no embed_tokens and no
hot_token_id: its DFLASH worker embeds the block with the target's embedding and drafts with the target's
full-vocabulary lm_head, so our lm_head (draft vocabulary), d2t and t2d are dropped without a word. Those tests
pin that limitation, and check everything else: every SGLang parameter holds our values, SGLang reads our block size,
mask token, target layers and RoPE, and SGLang's own code computes what eaglet's does (context keys and values
through fc, hidden_norm, k_proj, k_norm, RoPE; the block's final normed states).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch
from safetensors.torch import load_file, save_file

from contract.checkpoint import CheckpointContract
from models.dflash import DFlashDraft
from models.dflash_checkpoint import dflash_tensor_names
from models.draft_checkpoint import EXPECTED_TENSORS, WEIGHTS, save_pretrained
from models.draft_methods import method_config, new_draft
from models.eagle3 import Eagle3Config, Eagle3Draft
from models.vocab_mapping import build_vocab_mapping

REPO_ROOT = Path(__file__).resolve().parent.parent
PROBE = REPO_ROOT / "tests" / "sglang_load_weights.py"
CREATE_ENV = "make sglang-env   (the same as: bash tests/make_sglang_env.sh)"
NUM_TARGET_LAYERS = 6
AUX_LAYERS = [1, 2, 3]  # not the defaults for 6 layers, so the export writes eagle_aux_hidden_state_layer_ids
PROBE_TIMEOUT_S = 600

pytestmark = pytest.mark.usefixtures("sglang_loader_python")


LOADER_PYTHON = REPO_ROOT / ".venv-sglang-loader" / "bin" / "python"


def sglang_python() -> Path:
    """SGLang's loader-only venv (`make sglang-env`); its absence is a failure, not a skip."""
    python = LOADER_PYTHON
    if not python.is_file():
        pytest.fail(f"{python.relative_to(REPO_ROOT)} is missing: create SGLang's environment with\n    {CREATE_ENV}")
    return python


def tiny_draft() -> Eagle3Draft:
    """A random draft with every tensor distinct (so a swapped norm or a mis-stacked projection shows) and a
    real vocabulary mapping (64 of 256 ids)."""
    torch.manual_seed(0)
    config = Eagle3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=512,
                          vocab_size=256, draft_vocab_size=64, target_hidden_size=64, aux_layer_ids=AUX_LAYERS,
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)
    draft = Eagle3Draft(config)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.normal_(0.0, 0.05)
    counts = torch.randint(0, 1000, (config.vocab_size,))
    mapping = build_vocab_mapping(counts, config.vocab_size, config.draft_vocab_size)
    draft.set_vocab_mapping(mapping.d2t, mapping.t2d)
    return draft


def tiny_contract(config: Any) -> CheckpointContract:
    """The contract of a draft of the tiny test target (any method's config)."""
    return CheckpointContract(
        target_id="tiny", target_revision="rev", tokenizer_hash="tok", chat_template_hash=None, draft_config={},
        aux_layer_ids=config.aux_layer_ids, fusion_dims=[3 * config.target_hidden_size, config.hidden_size],
        hidden_size=config.hidden_size, vocab_size=config.vocab_size, draft_vocab_size=config.draft_vocab_size,
    )


def export_for_sglang(draft: Eagle3Draft, directory: Path) -> Path:
    return save_pretrained(draft, directory, tiny_contract(draft.config), num_target_layers=NUM_TARGET_LAYERS,
                           engine="sglang")


def break_export(source: Path, destination: Path) -> Path:
    """The same export with up_proj misnamed: SGLang skips it silently and leaves half of gate_up_proj unset."""
    destination.mkdir(parents=True)
    for name in ("config.json", "contract.json"):
        (destination / name).write_bytes((source / name).read_bytes())
    tensors = load_file(str(source / WEIGHTS))
    tensors["midlayer.mlp.upproj.weight"] = tensors.pop("midlayer.mlp.up_proj.weight")
    save_file(tensors, str(destination / WEIGHTS), metadata={"format": "pt"})
    return destination


def run_probe(*exports: Path, options: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The probe in SGLang's venv, one start-up for all exports; its exit status only says 'problems found'."""
    command = [str(sglang_python()), str(PROBE), *options, *map(str, exports)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    try:
        reports = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"{' '.join(command)} exited {result.returncode} without a report; stderr tail:\n{result.stderr[-4000:]}")
    return reports if isinstance(reports, list) else [reports]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("sglang-loader")
    good = export_for_sglang(tiny_draft(), directory / "good")
    broken = break_export(good, directory / "broken")
    good_report, broken_report = run_probe(good, broken)
    return {"good": good_report, "broken": broken_report}


def test_every_sglang_parameter_gets_our_values(reports: dict[str, Any]) -> None:
    report = reports["good"]
    assert report["problems"] == [], "\n".join(report["problems"])
    assert report["model_class"] == "sglang.srt.models.llama_eagle3.LlamaForCausalLMEagle3"
    parameters = report["parameters"]
    loaded = {name: entry for name, entry in parameters.items() if "from_target" not in entry}
    assert set(parameters) - set(loaded) == {"model.embed_tokens.weight"}, "only the embedding comes from the target"
    for name, entry in loaded.items():
        assert entry["nan_left"] == 0 and entry["equal"] and entry["shape"] == entry["expected_shape"], (name, entry)
    qkv = parameters["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv["shape"] == [(4 + 2 + 2) * 16, 2 * 64], "q, k and v stacked, each reading the 2H input"
    assert parameters["model.fc.weight"]["shape"] == [64, 3 * 64]
    assert parameters["lm_head.weight"]["shape"] == [64, 64], "lm_head over the draft vocabulary"
    assert not report["load_lm_head_from_target"] and report["embed_shared_from_target"]


def test_none_of_our_tensors_is_ignored(reports: dict[str, Any]) -> None:
    tensors = reports["good"]["tensors"]
    assert set(tensors) == set(EXPECTED_TENSORS)
    for name, entry in tensors.items():
        if name in ("d2t", "t2d"):
            continue
        assert entry["wrote"] and sum(entry["wrote"].values()) == entry["numel"], (name, entry)
    assert tensors["midlayer.mlp.up_proj.weight"]["wrote"] == {"model.layers.0.mlp.gate_up_proj.weight": 96 * 64}
    assert tensors["d2t"]["set_hot_token_id"] and not tensors["d2t"]["wrote"]
    assert not tensors["t2d"]["set_hot_token_id"] and not tensors["t2d"]["wrote"], "SGLang skips t2d by name"


def test_d2t_becomes_sglangs_hot_token_map(reports: dict[str, Any]) -> None:
    hot = reports["good"]["hot_token_id"]
    assert hot == {"present": True, "shape": [64], "dtype": "int64", "in_vocab": True, "unique": True,
                   "equals_d2t_plus_arange": True, "matches_t2d": True}


def test_sglang_reads_our_rope_and_aux_layers(reports: dict[str, Any]) -> None:
    report = reports["good"]
    rope = report["rope"]
    assert rope["base"] == 50000.0 and rope["rotary_dim"] == 16 and rope["cache_matches"]
    assert list(rope["buffers"]) == ["model.layers.0.self_attn.rotary_emb.cos_sin_cache"], "the only buffer"
    aux = report["aux_layers"]
    assert aux["eagle_aux_hidden_state_layer_ids"] == AUX_LAYERS
    assert aux["sglang_captures_outputs_of"] == AUX_LAYERS


def test_the_probe_sees_what_sglang_skips_silently(reports: dict[str, Any]) -> None:
    broken = reports["broken"]
    assert broken["tensors"]["midlayer.mlp.upproj.weight"]["use"] == "IGNORED"
    gate_up = broken["parameters"]["model.layers.0.mlp.gate_up_proj.weight"]
    assert gate_up["nan_left"] == 96 * 64, "the up half of gate_up_proj is never written"
    problems = "\n".join(broken["problems"])
    assert "midlayer.mlp.upproj.weight" in problems and "gate_up_proj" in problems and "never written" in problems


# DFlash: our DFlashDraftModel export through SGLang's sglang.srt.models.dflash.DFlashDraftModel.
DFLASH_LAYERS = 2
DFLASH_MASK_TOKEN = 5
DFLASH_BLOCK_SIZE = 4
#: Our tensors SGLang's DFlash draft has no parameter for (it borrows the target's lm_head, full vocabulary).
DFLASH_UNREAD = {"lm_head.weight", "d2t", "t2d"}
DFLASH_BROKEN = ("layers.1.self_attn.k_norm.weight", "layers.1.self_attn.key_norm.weight")


def tiny_dflash_draft() -> DFlashDraft:
    """A random 2-layer DFlash draft, every tensor distinct, norms near 1 and weights large enough for attention to
    be far from uniform (so a missing norm, a causal block or a context without k_norm shows in the forward check)."""
    torch.manual_seed(0)
    base = Eagle3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=512,
                        vocab_size=256, draft_vocab_size=64, target_hidden_size=64, aux_layer_ids=AUX_LAYERS,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0, mask_token_id=DFLASH_MASK_TOKEN)
    draft = new_draft(method_config(base, "dflash", num_layers=DFLASH_LAYERS, block_size=DFLASH_BLOCK_SIZE))
    assert isinstance(draft, DFlashDraft)
    with torch.no_grad():
        for parameter in draft.parameters():
            if parameter.dim() == 1:
                parameter.copy_(1.0 + 0.2 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.15)
    counts = torch.randint(0, 1000, (base.vocab_size,))
    mapping = build_vocab_mapping(counts, base.vocab_size, base.draft_vocab_size)
    draft.set_vocab_mapping(mapping.d2t, mapping.t2d)
    draft.attach_embedding(0.5 * torch.randn(base.vocab_size, base.hidden_size))  # the target's, never exported
    return draft


def export_dflash(draft: DFlashDraft, directory: Path) -> Path:
    return save_pretrained(draft, directory, tiny_contract(draft.config), num_target_layers=NUM_TARGET_LAYERS)


def dflash_forward_case(draft: DFlashDraft, path: Path, context_length: int = 7, root: int = 17) -> Path:
    """Inputs for the probe's forward check and eaglet's outputs on them (tests/sglang_load_weights.py,
    dflash_forward_report): a context of fused target states at positions 2..8, then one round's block
    [root, MASK x 3] right after it, attending to the whole context and the whole block (DFlashDraft.draft_block)."""
    torch.manual_seed(1)
    aux = torch.randn(context_length, 3 * draft.config.target_hidden_size)
    context_positions = torch.arange(2, 2 + context_length)
    ids = torch.full((DFLASH_BLOCK_SIZE,), DFLASH_MASK_TOKEN)
    ids[0] = root
    block_positions = torch.arange(DFLASH_BLOCK_SIZE) + int(context_positions[-1]) + 1
    visible = torch.ones(1, DFLASH_BLOCK_SIZE, context_length + DFLASH_BLOCK_SIZE, dtype=torch.bool)
    with torch.no_grad():
        context = draft.context(aux[None], context_positions[None])
        hidden = draft.block_forward(ids[None], block_positions[None], context, visible)
        case = {"aux": aux, "context_positions": context_positions, "block_embeds": draft.embed(ids),
                "block_positions": block_positions, "eaglet.block_normed": draft.norm(hidden)[0]}
        for index, layer_context in enumerate(context):
            case[f"eaglet.context.{index}.keys"] = layer_context.keys[0]
            case[f"eaglet.context.{index}.values"] = layer_context.values[0]
    save_file({name: value.contiguous() for name, value in case.items()}, str(path))
    return path


def break_dflash_export(source: Path, destination: Path) -> Path:
    """The same export with layer 1's k_norm misnamed: SGLang drops it silently (its norm would stay all ones)."""
    destination.mkdir(parents=True)
    for name in ("config.json", "contract.json"):
        (destination / name).write_bytes((source / name).read_bytes())
    tensors = load_file(str(source / WEIGHTS))
    old, new = DFLASH_BROKEN
    tensors[new] = tensors.pop(old)
    save_file(tensors, str(destination / WEIGHTS), metadata={"format": "pt"})
    return destination


@pytest.fixture(scope="module")
def dflash_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    directory = tmp_path_factory.mktemp("sglang-dflash")
    draft = tiny_dflash_draft()
    good = export_dflash(draft, directory / "good")
    broken = break_dflash_export(good, directory / "broken")
    case = dflash_forward_case(draft, directory / "forward_case.safetensors")
    good_report, broken_report = run_probe(good, broken, options=("--forward-case", str(case)))
    return {"good": good_report, "broken": broken_report}


def dflash_names() -> set[str]:
    return set(dflash_tensor_names(tiny_dflash_draft().config))


def test_dflash_every_sglang_parameter_gets_our_values(dflash_reports: dict[str, Any]) -> None:
    """SGLang's DFlashDraftModel.load_weights fills all its parameters from our names (q,k,v and gate,up stacked
    into qkv_proj and gate_up_proj, everything else by the same name, `model.` prefix optional)."""
    report = dflash_reports["good"]
    assert report["model_class"] == "sglang.srt.models.dflash.DFlashDraftModel"
    parameters = report["parameters"]
    for name, entry in parameters.items():
        assert entry["nan_left"] == 0 and entry["equal"] and entry["shape"] == entry["expected_shape"], (name, entry)
    read = {source for entry in parameters.values() for source in entry["sources"]}
    assert read == dflash_names() - DFLASH_UNREAD, "every tensor but the head and the vocabulary mapping is read"
    assert parameters["layers.0.self_attn.qkv_proj.weight"]["shape"] == [(4 + 2 + 2) * 16, 64]
    assert parameters["layers.1.mlp.gate_up_proj.weight"]["shape"] == [2 * 96, 64]
    assert parameters["fc.weight"]["shape"] == [64, 3 * 64], "fc over len(target_layer_ids) x hidden_size"
    assert "hidden_norm.weight" in parameters and "norm.weight" in parameters
    assert not any(name.startswith(("lm_head", "embed_tokens")) for name in parameters)


def test_dflash_sglang_drops_our_head_and_vocabulary_mapping(dflash_reports: dict[str, Any]) -> None:
    """The documented limitation: SGLang 0.5.23's DFlash draft has no lm_head and no draft vocabulary. Its
    load_weights skips lm_head.weight, d2t and t2d without a word (unknown names are ignored), no hot_token_id is
    set, and the DFLASH worker drafts by greedy argmax over the *target's* lm_head (full vocabulary) applied to the
    draft's normed states. So SGLang would serve our DFlash draft with a head it was not trained with; eaglet serves
    DFlash on vLLM only (tasks/serving/serving_setting.py SERVED_METHODS), and this test fails when SGLang changes."""
    report = dflash_reports["good"]
    tensors = report["tensors"]
    assert set(tensors) == dflash_names()
    ignored = {name for name, entry in tensors.items() if entry["use"] == "IGNORED"}
    assert ignored == DFLASH_UNREAD
    for name, entry in tensors.items():
        if name not in ignored:
            assert sum(entry["wrote"].values()) == entry["numel"], (name, entry)
    structure = report["structure"]
    assert not structure["has_lm_head"] and not structure["has_embed_tokens"] and not structure["hot_token_id"]
    assert report["hot_token_id"] == {"present": False}
    assert report["problems"] == [
        "our tensor d2t [64] was ignored by SGLang's load_weights",
        "our tensor lm_head.weight [64, 64] was ignored by SGLang's load_weights",
        "our tensor t2d [256] was ignored by SGLang's load_weights",
        "SGLang's DFlash draft has no lm_head: it drafts with the target's lm_head over the full vocabulary, not "
        "with our trained draft-vocabulary lm_head (lm_head.weight, d2t, t2d unused)",
    ], "nothing but the head and the vocabulary mapping is lost"


def test_dflash_sglang_reads_our_config(dflash_reports: dict[str, Any]) -> None:
    """Block size, mask token, the target layers captured (SGLang adds one to our output-of-layer ids, as it captures
    the state entering a layer), a non-causal block (ENCODER_ONLY: no layer_types in our config) and our RoPE."""
    report = dflash_reports["good"]
    structure = report["structure"]
    assert structure["num_layers"] == DFLASH_LAYERS and structure["block_size"] == DFLASH_BLOCK_SIZE
    assert structure["mask_token_id"] == DFLASH_MASK_TOKEN
    assert structure["target_layer_ids"] == AUX_LAYERS and structure["num_context_features"] == 3
    assert structure["layers_to_capture"] == {"LlamaForCausalLM": [2, 3, 4], "Qwen3ForCausalLM": [2, 3, 4]}
    assert structure["sglang_captures_outputs_of"] == AUX_LAYERS
    assert structure["attention_types"] == ["ENCODER_ONLY"] * DFLASH_LAYERS
    assert structure["sliding_windows"] == [-1] * DFLASH_LAYERS
    assert structure["context_kv_input"] == "hidden_norm(fc(aux))", "the context skips input_layernorm, as ours"
    rope = report["rope"]
    assert rope["base"] == 50000.0 and rope["rotary_dim"] == 16 and rope["is_neox_style"] and rope["cache_matches"]


def test_sglang_dflash_computes_what_eaglet_does(dflash_reports: dict[str, Any]) -> None:
    """SGLang's own DFlash code on our weights (float32; its attention kernel replaced by SDPA over [context; block])
    gives eaglet's context keys and values (fc -> hidden_norm -> k_proj -> k_norm -> RoPE at the context positions;
    v_proj without a norm) and eaglet's final normed block states, which SGLang hands to the target's lm_head."""
    forward = dflash_reports["good"]["forward"]
    for layer in range(DFLASH_LAYERS):
        for part in ("keys", "values"):
            entry = forward["context"][f"layers.{layer}"][part]
            assert entry["shape"] == [2, 7, 16], (layer, part, entry)
            assert entry["max_abs_diff"] <= 1e-5 * max(1.0, entry["max_abs"]), (layer, part, entry)
    block = forward["block_normed"]
    assert block["shape"] == [DFLASH_BLOCK_SIZE, 64], block
    assert block["max_abs_diff"] <= 1e-5 * max(1.0, block["max_abs"]), block


def test_the_probe_sees_a_dflash_norm_sglang_skips(dflash_reports: dict[str, Any]) -> None:
    old, new = DFLASH_BROKEN
    broken = dflash_reports["broken"]
    assert broken["tensors"][new]["use"] == "IGNORED"
    assert broken["parameters"][old]["nan_left"] == 16, "SGLang never writes layer 1's k_norm"
    problems = "\n".join(broken["problems"])
    assert new in problems and f"{old}: 16 of 16 elements never written" in problems
    assert "context layers.1 keys: SGLang computes something else" in problems


PARSE_SCRIPT = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(json.loads(sys.argv[1]))
names = ("model_path", "host", "port", "speculative_algorithm", "speculative_draft_model_path",
         "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens", "enable_metrics", "dtype",
         "disable_cuda_graph")
print(json.dumps({name: getattr(args, name) for name in names}))
"""


@pytest.mark.parametrize("steps, topk, num_draft_tokens, dtype, eager",
                         [(3, 1, None, "float32", True), (6, 10, 32, "bfloat16", False)])
def test_sglang_parses_our_serving_commands_as_meant(tmp_path: Path, steps: int, topk: int,
                                                     num_draft_tokens: int | None, dtype: str, eager: bool) -> None:
    """The benchmark's SGLang argv (a chain and a draft tree) through SGLang's own CLI parser: every flag exists
    and lands in the ServerArgs field we mean, with our value (serving needs a GPU; parsing does not)."""
    from tasks.serving.engine import EngineLaunch, engine_command

    launch = EngineLaunch(kind="sglang", model=tmp_path / "target", python="python", port=30001,
                          log_path=tmp_path / "log", draft=tmp_path / "draft", num_speculative_tokens=steps,
                          topk=topk, num_draft_tokens=num_draft_tokens, dtype=dtype, enforce_eager=eager)
    argv = engine_command(launch)[3:]  # after `python -m sglang.launch_server`
    done = subprocess.run([str(sglang_python()), "-c", PARSE_SCRIPT, json.dumps(argv)], capture_output=True,
                          text=True, timeout=PROBE_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed == {"model_path": str(tmp_path / "target"), "host": "127.0.0.1", "port": 30001,
                      "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(tmp_path / "draft"),
                      "speculative_num_steps": steps, "speculative_eagle_topk": topk,
                      "speculative_num_draft_tokens": num_draft_tokens or steps + 1, "enable_metrics": True,
                      "dtype": dtype, "disable_cuda_graph": eager}
