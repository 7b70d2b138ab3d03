"""Every supported target family end to end on real engines: a tiny random target of each (tests/tiny_families.py)
goes through target -> capture -> train -> export -> evaluate; vLLM's CPU build serves each family's drafter and its
per-position acceptance agrees with our offline decoder on the same prompts (one family also through the whole
benchmark stage: chat with and without the drafter, greedy outputs equal); SGLang's own loader fills every parameter of each export; each draft config carries the
family's attention shape, RoPE and norm epsilon, with a dense MLP.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from contract.config import RunConfig
from models.target_families import FAMILIES
from tasks.serving.engine import free_port
from test_sglang_loader import run_probe
from tiny_families import FAMILY_FIELDS, build_family_target

pytestmark = pytest.mark.usefixtures("vllm_python", "sglang_loader_python")


def test_every_family_in_the_table_has_a_tiny_target() -> None:
    assert set(FAMILY_FIELDS) == set(FAMILIES)


def family_config(root: Path, model_dir: Path, vllm_python: Path) -> RunConfig:
    """The benchmark test's drafted run (tests/test_benchmark.py) on another family's target."""
    return RunConfig.model_validate({
        "output_dir": str(root / "run"), "model": {"source": "local", "path": str(model_dir)},
        "capture": {"aux_layer_ids": [1, 2, 3], "dtype": "float32", "draft_vocab_size": 128},
        "training": {"ttt_length": 3, "learning_rate": 3e-3, "tokens_per_step": 64, "epochs": 8, "warmup_ratio": 0.1,
                     "save_interval": 1000, "eval_interval": 1000},
        "evaluation": {"steps": 3, "max_new_tokens": 24},
        "benchmark": {"engines": ["vllm"], "concurrency": [1], "num_requests": 6, "max_tokens": 16},  # the eval prompts
        "registry": {"agreement_min_drafts": 20},  # 6 prompts of 24 tokens: 36-70 drafts at these acceptances
        "runtime": {"engines": {"vllm": {"python": str(vllm_python), "port": free_port(),
                                         "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}}},
        "tracking": {"enabled": False},
    })


def drafted_family_run(root: Path, model_type: str, vllm_python: Path) -> RunConfig:
    """target, data (the target's own greedy answers), capture, train and evaluate for one family."""
    from tasks import evaluate
    from training_run import self_distilled_run, whole_word_target

    source = build_family_target(model_type, root / "random")
    cfg = self_distilled_run(family_config(root, whole_word_target(source, root / "target-source"), vllm_python))
    evaluate.run(cfg)
    return cfg


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory: pytest.TempPathFactory, vllm_python: Path) -> dict[str, RunConfig]:
    """Each family's drafted run, built on first use and shared by the tests below."""
    built: dict[str, RunConfig] = {}
    root = tmp_path_factory.mktemp("families")

    class Runs(dict):
        def __missing__(self, model_type: str) -> RunConfig:
            built[model_type] = drafted_family_run(root / model_type, model_type, vllm_python)
            self[model_type] = built[model_type]
            return built[model_type]

    return Runs()


def exported_config(cfg: RunConfig, engine: str) -> dict[str, Any]:
    return json.loads((cfg.output_path / "draft" / engine / "config.json").read_text())


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_draft_config_is_derived_from_the_family_target(family_runs: dict[str, RunConfig], model_type: str) -> None:
    from transformers import AutoConfig

    cfg = family_runs[model_type]
    target = AutoConfig.from_pretrained(cfg.output_path / "target").get_text_config()
    rope = dict(target.rope_parameters)
    for engine in ("vllm", "sglang"):
        draft = exported_config(cfg, engine)
        assert draft["architectures"] == ["LlamaForCausalLMEagle3"] and draft["num_hidden_layers"] == 1
        assert draft["head_dim"] == (getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads)
        assert (draft["num_attention_heads"], draft["num_key_value_heads"]) == (target.num_attention_heads,
                                                                               target.num_key_value_heads)
        assert draft["rms_norm_eps"] == target.rms_norm_eps
        assert draft["rope_theta"] == rope["rope_theta"]
        scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
        assert draft.get("rope_scaling") == (scaling if scaling.get("rope_type", "default") != "default" else None)
        assert not any("expert" in key for key in draft), "the draft's MLP is dense"
    width = exported_config(cfg, "vllm")["intermediate_size"]
    if model_type == "qwen3_moe":
        assert width == target.num_experts_per_tok * target.moe_intermediate_size
    elif model_type == "gpt_oss":
        assert width == target.num_experts_per_tok * target.intermediate_size
    else:
        assert width == target.intermediate_size


def test_vllm_serves_the_llama_target_with_its_drafter_faithfully(family_runs: dict[str, RunConfig]) -> None:
    """The benchmark stage itself, on one family: chat requests with and without the drafter, then the agreement
    run. The other families take the agreement replay alone (the test below): the chat path is the same code."""
    from tasks import benchmark

    cfg = family_runs["llama"]
    offline = json.loads((cfg.output_path / "evaluate" / "acceptance.json").read_text())["chain"]["mean_accept_length"]
    report = benchmark.run(cfg).report
    vllm = report["engines"]["vllm"]
    assert vllm["greedy"]["status"] == "ok" and vllm["greedy"]["mismatches"] == [], vllm["greedy"]
    window = vllm["eagle3"]["speculative"]["window"]
    assert window["drafts"] > 0 and window["draft_tokens"] == 3 * window["drafts"], "the engine drafted"
    check = vllm["acceptance_check"]
    assert check["status"] == "ok", check
    assert check["offline_mean_accept_length"] == pytest.approx(offline)
    print(f"\nllama: engine accept length {check['engine_mean_accept_length']:.3f}, offline {offline:.3f} "
          f"on the same {check['prompts']} prompts; per position engine/offline "
          f"{[(row['engine']['accepted'], row['offline']['accepted'], row['engine']['drafted']) for row in check['positions']]}")


@pytest.mark.parametrize("model_type", [model_type for model_type in FAMILIES if model_type != "llama"])
def test_vllm_drafts_each_family_as_the_offline_decoder_does(family_runs: dict[str, RunConfig], model_type: str) -> None:
    """The drafting engine alone replays the offline evaluation's prompts through `/v1/completions` with our token
    ids (gpt-oss included: vLLM's chat endpoint would render Harmony), and its per-position acceptance agrees."""
    from tasks import benchmark
    from tasks.serving.agreement import run_agreement
    from tasks.serving.engine import serve
    from tasks.serving.serving_setting import ServingSetting

    cfg = family_runs[model_type]
    steps, prompts = cfg.evaluation.steps, benchmark.agreement_prompts(cfg)
    launch = benchmark.engine_launch(cfg, "vllm", "agreement", cfg.output_path / "draft" / "vllm", ServingSetting(steps))
    with serve(launch) as engine:
        replies = run_agreement(engine, "vllm", prompts, cfg.evaluation.max_new_tokens, cfg.evaluation.temperature)
    assert all(row["output_tokens"] for row in replies) and sum(row["drafts"] for row in replies), "the engine drafted"
    check = benchmark.check_agreement(cfg, "vllm", [benchmark.VariantRun("eagle3", {"agreement": replies})], steps)
    assert check["status"] == "ok", check
    print(f"\n{model_type}: engine accept length {check['engine_mean_accept_length']:.3f}, offline "
          f"{check['offline_mean_accept_length']:.3f} on the same {check['prompts']} prompts")


def test_sglangs_loader_fills_every_parameter_of_every_family_export(family_runs: dict[str, RunConfig]) -> None:
    exports = [family_runs[model_type].output_path / "draft" / "sglang" for model_type in FAMILIES]
    for model_type, report in zip(FAMILIES, run_probe(*exports)):
        assert report["problems"] == [], (model_type, report["problems"])
        assert report["model_class"] == "sglang.srt.models.llama_eagle3.LlamaForCausalLMEagle3"
        for name, entry in report["parameters"].items():
            if "from_target" not in entry:
                assert entry["nan_left"] == 0 and entry["equal"], (model_type, name, entry)
        assert report["aux_layers"]["sglang_captures_outputs_of"] == [1, 2, 3], model_type
