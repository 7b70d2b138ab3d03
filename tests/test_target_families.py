"""Every supported target family end to end on real engines: a tiny random target of each (tests/tiny_families.py)
goes through target -> capture -> train -> export -> evaluate; vLLM's CPU build serves it with and without the
drafter (greedy outputs equal, speculative counters move, the engine-agreement check passes against our offline
decoder on the same prompts); SGLang's own loader fills every parameter of each export; each draft config carries the
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

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = pytest.mark.slow

#: The families vLLM serves through its chat endpoint here. gpt-oss is served through /v1/completions with our own
#: token ids instead: vLLM renders a gpt-oss chat in Harmony's o200k token ids whatever the target's tokenizer says
#: (the tiny target's ChatML vocabulary answers "Token id 200008 is out of vocabulary").
CHAT_SERVED = [model_type for model_type in FAMILIES if model_type != "gpt_oss"]


def test_every_family_in_the_table_has_a_tiny_target() -> None:
    assert set(FAMILY_FIELDS) == set(FAMILIES)


def family_config(root: Path, model_dir: Path) -> RunConfig:
    """The benchmark test's drafted run (tests/test_benchmark.py) on another family's target."""
    return RunConfig.model_validate({
        "output_dir": str(root / "run"), "model": {"source": "local", "path": str(model_dir)},
        "capture": {"aux_layer_ids": [1, 2, 3], "dtype": "float32", "draft_vocab_size": 128},
        "training": {"ttt_length": 3, "learning_rate": 3e-3, "tokens_per_step": 64, "epochs": 8, "warmup_ratio": 0.1,
                     "save_interval": 1000, "eval_interval": 1000},
        "evaluation": {"steps": 3, "max_new_tokens": 24},
        "benchmark": {"engines": ["vllm"], "concurrency": [1], "num_requests": 6, "max_tokens": 16},  # the eval prompts
        "registry": {"agreement_min_drafts": 20},  # 6 prompts of 24 tokens: 36-70 drafts at these acceptances
        "runtime": {"engines": {"vllm": {"python": str(VLLM_PYTHON), "port": free_port(),
                                         "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}}}},
        "tracking": {"enabled": False},
    })


def drafted_family_run(root: Path, model_type: str) -> RunConfig:
    """target, data (the target's own greedy answers), capture, train and evaluate for one family."""
    from tasks import evaluate
    from training_run import self_distilled_run, whole_word_target

    source = build_family_target(model_type, root / "random")
    cfg = self_distilled_run(family_config(root, whole_word_target(source, root / "target-source")))
    evaluate.run(cfg)
    return cfg


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunConfig]:
    """Each family's drafted run, built on first use and shared by the tests below."""
    built: dict[str, RunConfig] = {}
    root = tmp_path_factory.mktemp("families")

    class Runs(dict):
        def __missing__(self, model_type: str) -> RunConfig:
            built[model_type] = drafted_family_run(root / model_type, model_type)
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


@pytest.mark.parametrize("model_type", CHAT_SERVED)
def test_vllm_serves_the_family_target_with_its_drafter_faithfully(family_runs: dict[str, RunConfig],
                                                                   model_type: str) -> None:
    """The benchmark stage itself: chat requests with and without the drafter, then the agreement run."""
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"the vLLM engine environment is missing ({VLLM_PYTHON}): run `make serve-env`")
    from tasks import benchmark

    cfg = family_runs[model_type]
    offline = json.loads((cfg.output_path / "evaluate" / "acceptance.json").read_text())["chain"]["mean_accept_length"]
    report = benchmark.run(cfg).report
    vllm = report["engines"]["vllm"]
    assert vllm["greedy"]["status"] == "ok" and vllm["greedy"]["mismatches"] == [], vllm["greedy"]
    window = vllm["eagle3"]["speculative"]["window"]
    assert window["drafts"] > 0 and window["draft_tokens"] == 3 * window["drafts"], "the engine drafted"
    check = vllm["acceptance_check"]
    assert check["status"] == "ok", check
    assert check["offline_mean_accept_length"] == pytest.approx(offline)
    print(f"\n{model_type}: engine accept length {check['engine_mean_accept_length']:.3f}, offline {offline:.3f} "
          f"on the same {check['prompts']} prompts; per position engine/offline "
          f"{[(row['engine']['accepted'], row['offline']['accepted'], row['engine']['drafted']) for row in check['positions']]}")


def test_vllm_serves_gpt_oss_with_its_drafter_faithfully_through_completions(family_runs: dict[str, RunConfig]) -> None:
    """gpt-oss through `/v1/completions` with our rendered token ids (vLLM's chat endpoint renders Harmony): the
    target with and without the drafter gives the same greedy text, and the drafting engine agrees with offline."""
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"the vLLM engine environment is missing ({VLLM_PYTHON}): run `make serve-env`")
    from tasks import benchmark
    from tasks.serving.agreement import run_agreement
    from tasks.serving.engine import serve
    from tasks.serving.serving_setting import ServingSetting

    cfg = family_runs["gpt_oss"]
    steps, prompts = cfg.evaluation.steps, benchmark.agreement_prompts(cfg)
    replies = {}
    for variant, draft in (("baseline", None), ("eagle3", cfg.output_path / "draft" / "vllm")):
        launch = benchmark.engine_launch(cfg, "vllm", f"completions-{variant}", draft, ServingSetting(steps))
        with serve(launch) as engine:
            replies[variant] = run_agreement(engine, "vllm", prompts, cfg.evaluation.max_new_tokens,
                                             cfg.evaluation.temperature)
    assert [row["text"] for row in replies["eagle3"]] == [row["text"] for row in replies["baseline"]], "greedy equal"
    assert all(row["output_tokens"] for row in replies["baseline"]) and sum(row["drafts"] for row in replies["eagle3"])
    check = benchmark.check_agreement(cfg, "vllm", [benchmark.VariantRun("eagle3", {"agreement": replies["eagle3"]})],
                                      steps)
    assert check["status"] == "ok", check
    print(f"\ngpt_oss: engine accept length {check['engine_mean_accept_length']:.3f}, offline "
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
