"""Our `sglang` draft export through SGLang's own loader (`LlamaForCausalLMEagle3.load_weights`).

SGLang drops tensor names it does not know without a word, so these tests run tests/sglang_load_weights.py in
SGLang's own environment (.venv-sglang-loader): every SGLang parameter must be written, with our values after its
renaming and q/k/v, gate/up stacking; none of our tensors may be ignored; d2t must become hot_token_id.
A deliberately broken export shows the probe sees what SGLang skips silently.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from contract.checkpoint import CheckpointContract
from models.draft_checkpoint import EXPECTED_TENSORS, WEIGHTS, save_pretrained
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


def export_for_sglang(draft: Eagle3Draft, directory: Path) -> Path:
    config = draft.config
    contract = CheckpointContract(
        target_id="tiny", target_revision="rev", tokenizer_hash="tok", chat_template_hash=None, draft_config={},
        aux_layer_ids=config.aux_layer_ids, fusion_dims=[3 * config.target_hidden_size, config.hidden_size],
        hidden_size=config.hidden_size, vocab_size=config.vocab_size, draft_vocab_size=config.draft_vocab_size,
    )
    return save_pretrained(draft, directory, contract, num_target_layers=NUM_TARGET_LAYERS, engine="sglang")


def break_export(source: Path, destination: Path) -> Path:
    """The same export with up_proj misnamed: SGLang skips it silently and leaves half of gate_up_proj unset."""
    destination.mkdir(parents=True)
    for name in ("config.json", "contract.json"):
        (destination / name).write_bytes((source / name).read_bytes())
    tensors = load_file(str(source / WEIGHTS))
    tensors["midlayer.mlp.upproj.weight"] = tensors.pop("midlayer.mlp.up_proj.weight")
    save_file(tensors, str(destination / WEIGHTS), metadata={"format": "pt"})
    return destination


def run_probe(*exports: Path) -> list[dict[str, Any]]:
    """The probe in SGLang's venv, one start-up for all exports; its exit status only says 'problems found'."""
    command = [str(sglang_python()), str(PROBE), *map(str, exports)]
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


PARSE_SCRIPT = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(json.loads(sys.argv[1]))
names = ("model_path", "host", "port", "speculative_algorithm", "speculative_draft_model_path",
         "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens", "enable_metrics", "dtype")
print(json.dumps({name: getattr(args, name) for name in names}))
"""


@pytest.mark.parametrize("steps, topk, num_draft_tokens, dtype", [(3, 1, None, None), (6, 10, 32, "bfloat16")])
def test_sglang_parses_our_serving_commands_as_meant(tmp_path: Path, steps: int, topk: int,
                                                     num_draft_tokens: int | None, dtype: str | None) -> None:
    """The benchmark's SGLang argv (a chain and a draft tree) through SGLang's own CLI parser: every flag exists
    and lands in the ServerArgs field we mean, with our value (serving needs a GPU; parsing does not)."""
    from tasks.serving.engine import EngineLaunch, engine_command

    launch = EngineLaunch(kind="sglang", model=tmp_path / "target", python="python", port=30001,
                          log_path=tmp_path / "log", draft=tmp_path / "draft", num_speculative_tokens=steps,
                          topk=topk, num_draft_tokens=num_draft_tokens, dtype=dtype)
    argv = engine_command(launch)[3:]  # after `python -m sglang.launch_server`
    done = subprocess.run([str(sglang_python()), "-c", PARSE_SCRIPT, json.dumps(argv)], capture_output=True,
                          text=True, timeout=PROBE_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed == {"model_path": str(tmp_path / "target"), "host": "127.0.0.1", "port": 30001,
                      "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(tmp_path / "draft"),
                      "speculative_num_steps": steps, "speculative_eagle_topk": topk,
                      "speculative_num_draft_tokens": num_draft_tokens or steps + 1, "enable_metrics": True,
                      "dtype": dtype or "auto"}
