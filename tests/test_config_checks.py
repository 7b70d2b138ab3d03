"""The checks of a config against this machine and its target (flows/preflight.py), and `eaglet config validate`,
`eaglet stage` and `eaglet run` refusing before any stage runs, every problem printed at once and named by field.

Nothing here depends on what this machine has installed: missing engines are paths under tmp_path, present ones
this interpreter, and device counts are patched where a test needs more than the host has."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import flows.cli_common
import flows.preflight
from contract.config import RunConfig
from contract.config_loading import load_config
from flows.cli import app
from flows.preflight import preflight, usable_cpus

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIPPED_CONFIGS = ["params.yaml", *sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "configs").glob("*.yaml"))]
GOOD_CAPTURE = ["capture.aux_layer_ids=[1, 2, 3]", "capture.draft_vocab_size=128"]


def local_target(tmp_path: Path, target_dir: Path, *overrides: str) -> RunConfig:
    return load_config(None, [f"output_dir={tmp_path / 'out'}", "model.source=local", f"model.path={target_dir}",
                              *overrides])


def target_vocab(target_dir: Path) -> int:
    return json.loads((target_dir / "config.json").read_text())["vocab_size"]


def test_a_local_target_bounds_the_aux_layers_and_the_draft_vocab(tmp_path: Path, tiny_target_dir: Path) -> None:
    assert preflight(local_target(tmp_path, tiny_target_dir, *GOOD_CAPTURE)).problems == []
    vocab = target_vocab(tiny_target_dir)
    report = preflight(local_target(tmp_path, tiny_target_dir, "capture.aux_layer_ids=[1, 2, 6]",
                                    f"capture.draft_vocab_size={vocab + 1}"))
    first, second = report.problems
    assert first.startswith("capture.aux_layer_ids: id 6 at position 2 is out of range: the target has 6 decoder layers")
    assert str(tiny_target_dir / "config.json") in first
    assert second.startswith(f"capture.draft_vocab_size: {vocab + 1} is more than the target's vocabulary of {vocab}")
    assert preflight(local_target(tmp_path, tiny_target_dir, "capture.aux_layer_ids=[1, 2, 5]",
                                  f"capture.draft_vocab_size={vocab}")).problems == [], "the last layer and the whole vocab fit"


def test_the_default_aux_layers_are_checked_against_the_target(tmp_path: Path, tiny_target_dir: Path) -> None:
    (problem,) = preflight(local_target(tmp_path, tiny_target_dir, "capture.draft_vocab_size=128")).problems
    assert "the default aux layers [1, N//2 - 1, N - 4] = [1, 2, 2]" in problem and "set capture.aux_layer_ids" in problem


def test_an_unsupported_architecture_fails_config_validate_naming_it_and_the_supported_list(tmp_path: Path,
                                                                                             tiny_target_dir: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    config = json.loads((tiny_target_dir / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**config, "model_type": "falcon", "architectures": ["FalconForCausalLM"]}))
    result = CliRunner().invoke(app, ["config", "validate", f"output_dir={tmp_path / 'out'}", "model.source=local",
                                      f"model.path={foreign}", *GOOD_CAPTURE])
    assert result.exit_code == 2, result.output
    output = " ".join(result.output.split())
    assert "target architecture (model_type) 'falcon' is not supported" in output
    assert "llama, qwen2, qwen3, qwen3_moe, gpt_oss" in output and str(foreign / "config.json") in output


def materialise(out: Path, **info: object) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "target.json").write_text(json.dumps(info))


def test_a_materialised_target_is_checked_and_a_missing_one_is_not_yet(tmp_path: Path) -> None:
    out = tmp_path / "out"
    embedded = load_config(None, [f"output_dir={out}", "capture.draft_vocab_size=8192"])
    absent = preflight(embedded)
    assert absent.problems == []
    assert absent.not_checked == [f"the target's architecture, capture.aux_layer_ids, capture.draft_vocab_size: target not materialised "
                                  f"(no {out / 'target.json'} for this model)"]
    materialise(out, source="embedded", id=embedded.model.id, num_hidden_layers=30, vocab_size=4096)
    checked = preflight(embedded)
    assert checked.not_checked == []
    assert checked.problems == [f"capture.draft_vocab_size: 8192 is more than the target's vocabulary of 4096 tokens "
                                f"(target: {out / 'target.json'})"]
    materialise(out, source="hub", id="someone/another-model", num_hidden_layers=2, vocab_size=10)
    assert preflight(embedded).not_checked, "another model's target says nothing about this one"


def test_a_local_target_that_is_not_there_is_not_checked_yet(tmp_path: Path) -> None:
    report = preflight(local_target(tmp_path, tmp_path / "nowhere"))
    assert report.problems == [] and "target not materialised" in report.not_checked[0]


def test_cpu_ranks_are_bounded_by_the_usable_cores(tmp_path: Path) -> None:
    def ranks(count: int) -> list[str]:
        return preflight(load_config(None, [f"output_dir={tmp_path}", "runtime.device=cpu",
                                            f"deployment.trainer.nproc_per_node={count}"])).problems

    assert ranks(usable_cpus()) == []
    assert ranks(usable_cpus() + 1) == [f"deployment.trainer.nproc_per_node: {usable_cpus() + 1} ranks, but this host "
                                        f"has {usable_cpus()} usable CPU cores (runtime.device cpu)"]


def test_gpu_ranks_are_bounded_by_the_visible_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    two = load_config(None, [f"output_dir={tmp_path}", "deployment.trainer.nproc_per_node=2"])
    assert preflight(two).problems == []
    (problem,) = preflight(load_config(None, [f"output_dir={tmp_path}", "deployment.trainer.nproc_per_node=3"])).problems
    assert problem == "deployment.trainer.nproc_per_node: 3 ranks, but this host has 2 visible CUDA devices (runtime.device auto)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    on_cuda = load_config(None, [f"output_dir={tmp_path}", "runtime.device=cuda", "deployment.trainer.nproc_per_node=2"])
    assert "has 0 visible CUDA devices (runtime.device cuda)" in preflight(on_cuda).problems[0]


def test_every_engine_the_run_starts_needs_its_python(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    regenerating = [f"output_dir={tmp_path}", "regeneration.backend=openai", "regeneration.engine=vllm",
                    f"runtime.engines.vllm.python={missing}"]
    (problem,) = preflight(load_config(None, regenerating)).problems
    assert problem.startswith(f"runtime.engines.vllm.python: '{missing}' is not an executable python")
    assert "regeneration.engine starts this engine" in problem and "make serve-env" in problem
    served_elsewhere = preflight(load_config(None, [*regenerating, "regeneration.base_url=http://127.0.0.1:9/v1"]))
    assert served_elsewhere.problems == [], "a given base_url starts no engine"
    assert preflight(load_config(None, [*regenerating, "regeneration.enabled=false"])).problems == []
    benchmarking = [f"output_dir={tmp_path}", "benchmark.engines=[vllm, sglang]", f"runtime.engines.vllm.python={sys.executable}",
                    f"runtime.engines.sglang.python={missing}"]
    (problem,) = preflight(load_config(None, benchmarking)).problems
    assert problem.startswith(f"runtime.engines.sglang.python: '{missing}'") and "benchmark.engines starts" in problem


def broken_config(tmp_path: Path, tiny_target_dir: Path) -> Path:
    """A config valid on paper that this machine cannot run, for four reasons."""
    config = {"output_dir": str(tmp_path / "out"), "model": {"source": "local", "path": str(tiny_target_dir)},
              "data": {"sources": [{"name": "mtbench", "asset": "mtbench", "limit": 2}]},
              "capture": {"aux_layer_ids": [1, 2, 9], "draft_vocab_size": 100_000},
              "deployment": {"trainer": {"nproc_per_node": usable_cpus() + 1}},
              "runtime": {"device": "cpu", "engines": {"vllm": {"python": str(tmp_path / "no-venv" / "bin" / "python")}}},
              "regeneration": {"backend": "openai", "engine": "vllm"}, "tracking": {"enabled": False}}
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def assert_every_problem_named(output: str) -> None:
    for field in ("capture.aux_layer_ids: id 9", "capture.draft_vocab_size: 100000",
                  "deployment.trainer.nproc_per_node", "runtime.engines.vllm.python"):
        assert field in output, (field, output)


def test_config_validate_prints_every_problem_and_exits_2(tmp_path: Path, tiny_target_dir: Path) -> None:
    result = CliRunner().invoke(app, ["config", "validate", "--config", str(broken_config(tmp_path, tiny_target_dir))])
    assert result.exit_code == 2, result.output
    assert "this run cannot start here" in result.output and "is a valid run config" not in result.output
    assert_every_problem_named(result.output)


def test_stage_and_run_refuse_before_any_stage_runs(tmp_path: Path, tiny_target_dir: Path) -> None:
    config = str(broken_config(tmp_path, tiny_target_dir))
    for command in (["stage", "ingest", "--config", config], ["ingest", "--config", config], ["train", "--config", config],
                    ["run", "--config", config, "--stages", "target,ingest"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, (command, result.output)
        assert_every_problem_named(result.output)
    assert not (tmp_path / "out").exists(), "no stage ran"


def test_config_validate_says_what_it_could_not_check_yet(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["config", "validate", f"output_dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    assert "not checked yet: the target's architecture, capture.aux_layer_ids, capture.draft_vocab_size: target not materialised" in result.output
    assert "ok: <defaults> is a valid run config" in result.output


def ample_machine(monkeypatch: pytest.MonkeyPatch, engines_installed: bool) -> None:
    """A host with many devices, with or without every engine's environment."""
    monkeypatch.setattr(flows.preflight, "rank_slots", lambda device: (64, "visible CUDA devices"))
    monkeypatch.setattr(flows.preflight, "resolve_python", lambda python: python if engines_installed else None)


@pytest.mark.parametrize("name", SHIPPED_CONFIGS)
def test_shipped_configs_pass_config_validate(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ample_machine(monkeypatch, engines_installed=True)
    result = CliRunner().invoke(app, ["config", "validate", "--config", str(REPO_ROOT / name), f"output_dir={tmp_path}"])
    assert result.exit_code == 0, result.output


def test_the_gpu_recipe_without_its_engine_names_the_missing_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where .venv-sglang is missing the benchmark would fail, so validating the recipe there fails, saying why."""
    ample_machine(monkeypatch, engines_installed=False)
    result = CliRunner().invoke(app, ["config", "validate", "--config", str(REPO_ROOT / "configs/llama31-8b-sglang.yaml"),
                                      f"output_dir={tmp_path}"])
    assert result.exit_code == 2, result.output
    assert "runtime.engines.sglang.python: '.venv-sglang/bin/python' is not an executable python" in result.output
    assert "runtime.engines.vllm" not in result.output, "regeneration is served at its base_url: vLLM is not started"


def test_schema_only_checks_a_cluster_config_on_a_laptop(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--schema-only` runs the field and cross-field rules and nothing of this host (it says so); plain validate
    still checks the host, as every run does before it starts."""
    gpu_recipe = ["config", "validate", "--config", str(REPO_ROOT / "configs/llama31-8b-sglang.yaml")]
    monkeypatch.setattr(flows.preflight, "rank_slots", lambda device: (0, "visible CUDA devices"))
    monkeypatch.setattr(flows.preflight, "resolve_python", lambda python: None)
    plain = CliRunner().invoke(app, gpu_recipe)
    assert plain.exit_code == 2, plain.output
    assert "deployment.trainer.nproc_per_node: 8 ranks, but this host has 0 visible CUDA devices" in plain.output
    assert "runtime.engines.sglang.python" in plain.output

    def no_host_checks(cfg: RunConfig) -> None:
        raise AssertionError("--schema-only ran the host checks")

    monkeypatch.setattr(flows.cli_common, "preflight", no_host_checks)
    schema = CliRunner().invoke(app, [*gpu_recipe[:2], "--schema-only", *gpu_recipe[2:]])
    assert schema.exit_code == 0, schema.output
    output = " ".join(schema.output.split())
    assert "not checked (--schema-only): the target's architecture" in output and "nproc_per_node" in output
    assert "llama31-8b-sglang.yaml is a valid run config on paper" in output
    cross_field = CliRunner().invoke(app, [*gpu_recipe[:2], "--schema-only", *gpu_recipe[2:],
                                           "evaluation.num_draft_tokens=1000"])
    assert cross_field.exit_code == 2, cross_field.output
    assert "evaluation.num_draft_tokens: 1000 cannot be verified by a tree of steps 6 x topk 10" in " ".join(
        cross_field.output.split())
