"""How the engines execute (tasks/serving/engine_settings.py): a bf16 target on a GPU is served in bf16 with CUDA
graphs by both engines beside a bf16 export, a CPU run keeps float32 and eager, the overrides of
runtime.engines.<engine> reach the command, `gpus` reaches the engine's environment, and the benchmark report says
which of them it measured. Commands, environments and configs only: no engine starts here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoConfig

from contract.config import RunConfig
from contract.config_loading import load_config
from models.eagle3 import Eagle3Config, Eagle3Draft
from tasks import benchmark
from tasks.registry.doctor import inspect_checkpoint, resolve_target_info
from tasks.serving.engine import engine_command, engine_environment
from tasks.serving.engine_settings import engine_execution
from tasks.serving.serving_setting import ServingSetting
from tasks.training.outputs import export
from test_benchmark import canned_inputs, canned_variant, prompt_record

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPE = REPO_ROOT / "configs" / "llama31-8b-sglang.yaml"


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def exported_run(tmp_path: Path, tiny_target_dir: Path, **fields: object) -> RunConfig:
    """A run whose train stage exported a random drafter of the tiny target (the real export code)."""
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), **fields})
    (tmp_path / "target.json").write_text(json.dumps(resolve_target_info(tiny_target_dir)))
    target = AutoConfig.from_pretrained(tiny_target_dir)
    torch.manual_seed(0)
    draft = Eagle3Draft(Eagle3Config.from_target(target, draft_vocab_size=target.vocab_size, aux_layer_ids=[1, 2, 3]))
    export(cfg, draft, {}, steps=1, world_size=1, eval_metrics={}, compute_dtype="bfloat16")
    return cfg


def float_dtypes(export_dir: Path) -> set[torch.dtype]:
    """The dtypes of an export's floating-point tensors (the vocab mapping's are integers and booleans)."""
    tensors = load_file(str(export_dir / "model.safetensors"))
    return {tensor.dtype for tensor in tensors.values() if tensor.is_floating_point()}


def drafted_command(cfg: RunConfig, kind: str) -> list[str]:
    """The benchmark's command for the engine drafting with the run's export."""
    launch = benchmark.engine_launch(cfg, kind, "eagle3", cfg.output_path / "draft" / kind, ServingSetting(3))
    return engine_command(launch)


def test_a_bf16_target_on_a_gpu_is_served_in_bf16_with_cuda_graphs_beside_a_bf16_export(
        tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = exported_run(tmp_path, tiny_target_dir, model={"dtype": "bfloat16"}, runtime={"device": "cuda"})
    for kind in ("sglang", "vllm"):
        export_dir = cfg.output_path / "draft" / kind
        assert json.loads((export_dir / "config.json").read_text())["torch_dtype"] == "bfloat16", kind
        assert float_dtypes(export_dir) == {torch.bfloat16}, kind
        command = drafted_command(cfg, kind)
        assert flag(command, "--dtype") == "bfloat16" and command.count("--dtype") == 1, command
        failed = [check for check in inspect_checkpoint(export_dir, resolve_target_info(tiny_target_dir))
                  if not check.ok]
        assert failed == [], "eaglet registry doctor accepts the bf16 export"
    sglang, vllm = drafted_command(cfg, "sglang"), drafted_command(cfg, "vllm")
    assert flag(sglang, "--speculative-draft-model-path") == str(cfg.output_path / "draft" / "sglang")
    assert "--disable-cuda-graph" not in sglang and "--enforce-eager" not in vllm, "CUDA graphs on a GPU"
    assert json.loads(flag(vllm, "--speculative-config"))["model"] == str(cfg.output_path / "draft" / "vllm")


def test_a_cpu_run_keeps_float32_eager_engines_and_a_float32_export(tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = exported_run(tmp_path, tiny_target_dir, runtime={"device": "cpu"})
    draft = cfg.output_path / "draft" / "vllm"
    assert json.loads((draft / "config.json").read_text())["torch_dtype"] == "float32"
    assert float_dtypes(draft) == {torch.float32}
    python = cfg.runtime.engines["vllm"].python
    spec = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})
    assert drafted_command(cfg, "vllm") == [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(cfg.output_path / "target"),
        "--host", "127.0.0.1", "--port", "8100", "--served-model-name", "target", "--enforce-eager",
        "--dtype", "float32", "--speculative-config", spec], "the CPU command as it always was"
    sglang = drafted_command(cfg, "sglang")
    assert flag(sglang, "--dtype") == "float32" and "--disable-cuda-graph" in sglang, "named, not SGLang's auto"


@pytest.mark.parametrize("device, setting, eager", [("cuda", True, True), ("cuda", "true", True),
                                                    ("cpu", False, False), ("cpu", "auto", True)])
def test_enforce_eager_overrides_auto_on_both_engines(tmp_path: Path, device: str, setting: object,
                                                      eager: bool) -> None:
    engines = {kind: {"enforce_eager": setting, "dtype": "float16"} for kind in ("vllm", "sglang")}
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "model": {"dtype": "bfloat16"},
                                    "runtime": {"device": device, "engines": engines}})
    vllm, sglang = drafted_command(cfg, "vllm"), drafted_command(cfg, "sglang")
    assert ("--enforce-eager" in vllm, "--disable-cuda-graph" in sglang) == (eager, eager)
    assert flag(vllm, "--dtype") == flag(sglang, "--dtype") == "float16", "an explicit dtype wins over model.dtype"
    assert engine_execution(cfg, "vllm").as_report() == {"dtype": "float16", "enforce_eager": eager, "gpus": None}


def test_gpus_become_the_engines_cuda_visible_devices(tmp_path: Path) -> None:
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path), "runtime": {"engines": {"sglang": {"gpus": [2, 3]}}}})
    inherited = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "PATH": "/usr/bin"}
    placed = benchmark.engine_launch(cfg, "sglang", "baseline", None, ServingSetting(3))
    assert engine_environment(placed, inherited) == {"CUDA_VISIBLE_DEVICES": "2,3", "PATH": "/usr/bin",
                                                     "PYTHONUNBUFFERED": "1"}
    unplaced = benchmark.engine_launch(cfg, "vllm", "baseline", None, ServingSetting(3))
    assert engine_environment(unplaced, inherited)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3", "unset: the caller's"

    placed.env["CUDA_VISIBLE_DEVICES"] = "1"  # e.g. benchmark.replay_engine_env beside runtime.engines.sglang.gpus
    with pytest.raises(ValueError, match=r"runtime.engines.sglang.gpus \(2,3\) and CUDA_VISIBLE_DEVICES"):
        engine_environment(placed, inherited)
    with pytest.raises(ValidationError, match="gpus and env.CUDA_VISIBLE_DEVICES both place the engine"):
        RunConfig.model_validate({"runtime": {"engines": {"vllm": {"gpus": "0",
                                                                   "env": {"CUDA_VISIBLE_DEVICES": "1"}}}}})
    with pytest.raises(ValidationError, match="gpus must be a comma-separated device list"):
        RunConfig.model_validate({"runtime": {"engines": {"vllm": {"gpus": "0, 1"}}}})


def test_the_sglang_recipe_places_its_engine_and_serves_the_8b_target_in_bf16_with_cuda_graphs(
        tmp_path: Path) -> None:
    cfg = load_config(RECIPE, [f"output_dir={tmp_path}", "regeneration.base_url=http://127.0.0.1:39999/v1"])
    launch = benchmark.engine_launch(cfg, "sglang", "eagle3", tmp_path / "draft" / "sglang", ServingSetting(6))
    assert engine_environment(launch, {})["CUDA_VISIBLE_DEVICES"] == "0"
    command = engine_command(launch)
    assert flag(command, "--dtype") == "bfloat16" and "--disable-cuda-graph" not in command


def test_the_benchmark_report_says_how_each_engine_executed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    canned_inputs(tmp_path, "vllm")
    record = prompt_record("s:1", [{"role": "user", "content": "question"}, {"role": "assistant", "content": "a"}])
    (tmp_path / "data" / "eval.jsonl").write_text(record.model_dump_json() + "\n")
    cfg = RunConfig.model_validate({
        "output_dir": str(tmp_path), "tracking": {"enabled": False}, "model": {"dtype": "bfloat16"},
        "runtime": {"device": "cuda", "engines": {"vllm": {"gpus": "1"}}},
        "benchmark": {"engines": ["vllm"], "concurrency": [1], "num_requests": 1}})
    monkeypatch.setattr(benchmark, "measure_variant", canned_variant)  # what the engine measured, without one
    assert benchmark.run(cfg).report["passed"]
    report = json.loads((tmp_path / "benchmark" / "report.json").read_text())
    assert report["engines"]["vllm"]["execution"] == {"dtype": "bfloat16", "enforce_eager": False, "gpus": "1"}
