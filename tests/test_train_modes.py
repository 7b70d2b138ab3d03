"""Training modes beyond the default: online features, gradient accumulation, FSDP2, bf16 autocast, attention
backends. All on the tiny target's captured run (tests/training_run.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from models.teacher import Teacher
from models.ttt import causal_plus_diagonal_attention, check_attention_backend
from tasks import train
from tasks.features.batches import collate
from tasks.common.host_compute import host_compute
from tasks.features.shards import FeatureSet
from tasks.serving.engine import free_port
from tasks.training.checkpoint import ResumeRefused, latest_checkpoint
from tasks.training.launch import other_node_commands
from attention_reference import assert_within_bf16
from training_run import copied_run


@pytest.fixture(scope="module")
def base_run(captured_tiny_run):
    """The session's captured run with 8 steps: every test trains in a copy of it (`fresh`)."""
    return captured_tiny_run.model_copy(update={"training": captured_tiny_run.training.model_copy(update={"max_steps": 8})})


def fresh(base_run, tmp_path: Path, name: str, ranks: int = 1, strategy: str = "ddp", **training):
    copied = copied_run(base_run, tmp_path / name, **training)
    trainer = copied.deployment.trainer.model_copy(update={"nproc_per_node": ranks, "strategy": strategy})
    return copied.model_copy(update={"deployment": copied.deployment.model_copy(update={"trainer": trainer})})


def resumed(cfg):
    return cfg.model_copy(update={"training": cfg.training.model_copy(update={"halt_after": None, "resume_from": "auto"})})


def losses(cfg) -> dict[int, float]:
    rows = [json.loads(line) for line in (cfg.output_path / "train" / "steps.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def close(first: dict[int, float], second: dict[int, float], tolerance: float = 1e-5) -> bool:
    return first.keys() == second.keys() and all(abs(first[step] - second[step]) < tolerance for step in first)


def exported(cfg) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(cfg.output_path / "draft" / "sglang" / "model.safetensors"))


def test_online_training_matches_offline_without_shards(base_run, tmp_path: Path) -> None:
    offline = fresh(base_run, tmp_path, "offline")
    offline_result = train.run(offline)
    online = fresh(base_run, tmp_path, "online", mode="online")
    shutil.rmtree(online.output_path / "features")  # online needs no captured shards
    online_result = train.run(online)
    assert not (online.output_path / "features").exists()
    assert close(losses(offline), losses(online)), (losses(offline), losses(online))
    for key in ("eval_acc_0", "eval_simulated_accept_len"):
        assert abs(offline_result.values[key] - online_result.values[key]) < 1e-5
    saved = json.loads((latest_checkpoint(online.output_path / "checkpoints") / "trainer_state.json").read_text())
    assert saved["math"]["training.mode"] == "online"
    contract = json.loads((online.output_path / "draft" / "vllm" / "contract.json").read_text())
    assert contract["training"]["mode"] == "online" and contract["training"]["dtype"] == "float32"


def test_accumulated_micro_batches_give_the_gradient_of_their_union(base_run) -> None:
    features = FeatureSet(base_run.output_path / "features", "train")
    heads = train.load_target_heads(base_run.output_path / "target")
    draft = train.build_draft(base_run, heads, features.manifest, torch.device("cpu"))
    step = train.TTTStep(draft, base_run.training.ttt_length)
    teacher = Teacher(heads.lm_head, draft.t2d)
    records = features.records([0, 1, 2])
    normaliser = sum(len(record["input_ids"]) for record in records)

    def gradients(batches: list[list[dict]]) -> dict[str, torch.Tensor]:
        draft.zero_grad(set_to_none=True)
        for batch in batches:
            loss, _ = step(collate(batch, teacher), normaliser)
            loss.backward()
        return {name: parameter.grad.clone() for name, parameter in draft.named_parameters() if parameter.grad is not None}

    union = gradients([records])
    accumulated = gradients([records[:2], records[2:]])
    assert union.keys() == accumulated.keys() and union
    for name in union:
        torch.testing.assert_close(accumulated[name], union[name], rtol=1e-5, atol=1e-7, msg=name)


def test_accumulation_counts_optimizer_steps_and_resumes_exactly(base_run, tmp_path: Path) -> None:
    plain = fresh(base_run, tmp_path, "plain", max_steps=None, epochs=1)
    train.run(plain)
    straight = fresh(base_run, tmp_path, "accumulated", max_steps=None, epochs=1, grad_accumulation=2)
    result = train.run(straight)
    micro_batches = len(losses(plain))
    assert result.values["steps"] == (micro_batches + 1) // 2 and result.values["complete"]
    halted = fresh(base_run, tmp_path, "halted", max_steps=None, epochs=1, grad_accumulation=2, halt_after=2)
    train.run(halted)
    train.run(resumed(halted))
    assert losses(halted) == losses(straight)
    assert all(torch.equal(exported(straight)[name], exported(halted)[name]) for name in exported(straight))


def test_bf16_autocast_keeps_fp32_master_weights(base_run, tmp_path: Path) -> None:
    cfg = fresh(base_run, tmp_path, "bf16", precision="bf16", max_steps=3)
    result = train.run(cfg)
    assert result.values["complete"] and all(torch.isfinite(torch.tensor(list(losses(cfg).values()))))
    checkpoint = latest_checkpoint(cfg.output_path / "checkpoints")
    from safetensors.torch import load_file

    assert {value.dtype for name, value in load_file(str(checkpoint / "draft.safetensors")).items()
            if value.is_floating_point()} == {torch.float32}
    saved = json.loads((checkpoint / "trainer_state.json").read_text())
    assert saved["math"]["training.precision"] == "bfloat16" and result.values["precision"] == "bfloat16"
    contract = json.loads((cfg.output_path / "draft" / "vllm" / "contract.json").read_text())
    assert contract["training"]["dtype"] == "bfloat16"
    assert contract["training"]["host"] == result.values["host"] == host_compute().as_record()
    fp32 = fresh(base_run, tmp_path, "fp32-resume", resume_from=str(checkpoint), precision="fp32")
    with pytest.raises(ResumeRefused, match="training.precision: checkpoint 'bfloat16', run 'float32'"):
        train.run(fp32)


def test_auto_precision_trains_in_bf16_exactly_where_the_cpu_has_bf16_units(base_run, tmp_path: Path) -> None:
    cfg = fresh(base_run, tmp_path, "auto", precision="auto", max_steps=2)
    result = train.run(cfg)
    expected = "bfloat16" if host_compute().native_bf16_matmul else "float32"
    assert result.values["precision"] == expected, host_compute().describe()


def flash_attn_runs_here() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(flash_attn_runs_here(), reason="flash-attn runs here: the equivalence test below covers it")
def test_flash_attention_backend_is_refused_where_it_cannot_run(base_run, tmp_path: Path) -> None:
    reason = "needs a CUDA GPU; use 'sdpa' on CPU" if not torch.cuda.is_available() else "needs the flash-attn package"
    with pytest.raises(ValueError, match=f"'flash_attn' {reason}"):
        train.run(fresh(base_run, tmp_path, "flash", attention_backend="flash_attn"))
    assert not (tmp_path / "flash" / "checkpoints").exists()


def gpu_attention_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """fp32 queries, keys, values and two diagonal terms on the GPU; queries and keys scaled by 6 (scores of
    std 36), where a merge that loses precision shows."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    queries = torch.randn(2, 4, 33, 64, device="cuda", generator=generator).mul(6).requires_grad_()
    keys = torch.randn(2, 2, 33, 64, device="cuda", generator=generator) * 6
    values = torch.randn(2, 2, 33, 64, device="cuda", generator=generator)
    diagonal_keys = [torch.randn(2, 2, 33, 64, device="cuda", generator=generator) * 6 for _ in range(2)]
    diagonal_values = [torch.randn(2, 2, 33, 64, device="cuda", generator=generator) for _ in range(2)]
    return queries, keys, values, diagonal_keys, diagonal_values


@pytest.mark.skipif(not flash_attn_runs_here(), reason="flash-attn runs on CUDA GPUs with the package only")
def test_flash_attention_matches_sdpa_on_gpu() -> None:
    """flash_attn computes in bf16: within what bf16 allows of the exact attention over the same inputs."""
    check_attention_backend("flash_attn")
    inputs = gpu_attention_inputs()
    assert_within_bf16(causal_plus_diagonal_attention(*inputs, backend="flash_attn"), *inputs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's bf16 SDPA kernels need a CUDA GPU")
def test_bf16_autocast_attention_on_gpu_is_within_bf16() -> None:
    """training.precision bf16 with the default sdpa backend, as the GPU trains."""
    inputs = gpu_attention_inputs()
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        attended = causal_plus_diagonal_attention(*inputs, backend="sdpa")
    assert_within_bf16(attended, *inputs)


@pytest.mark.integration
def test_fsdp_two_ranks_match_one_rank_and_resume_exactly(base_run, tmp_path: Path) -> None:
    one = fresh(base_run, tmp_path, "one", grad_accumulation=2)
    train.run(one)
    sharded = fresh(base_run, tmp_path, "fsdp", ranks=2, strategy="fsdp", grad_accumulation=2)
    result = train.run(sharded)
    assert result.values["world_size"] == 2 and result.values["strategy"] == "fsdp" and result.values["complete"]
    assert close(losses(one), losses(sharded)), (losses(one), losses(sharded))
    for name, value in exported(one).items():
        torch.testing.assert_close(exported(sharded)[name], value, rtol=1e-4, atol=1e-6, msg=name)

    halted = fresh(base_run, tmp_path, "fsdp-halted", ranks=2, strategy="fsdp", grad_accumulation=2, halt_after=3)
    train.run(halted)
    train.run(resumed(halted))
    assert losses(halted) == losses(sharded)
    assert all(torch.equal(exported(sharded)[name], exported(halted)[name]) for name in exported(sharded))


def test_two_nodes_on_one_host_match_one_rank(base_run, tmp_path: Path, capfd: pytest.CaptureFixture,
                                             subprocesses: None) -> None:
    """Two torchrun launchers on 127.0.0.1, one rank each, joined by a c10d rendezvous: eaglet starts node 0 and
    prints node 1's command, which the test runs as the other node would."""
    one = fresh(base_run, tmp_path, "one")
    train.run(one)
    nodes = fresh(base_run, tmp_path, "nodes")
    trainer = nodes.deployment.trainer.model_copy(update={"nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{free_port()}"})
    nodes = nodes.model_copy(update={"deployment": nodes.deployment.model_copy(update={"trainer": trainer})})
    (line,) = other_node_commands(nodes, None).values()
    assert "--rdzv_backend=c10d" in line and "--node_rank=1" in line and "--standalone" not in line
    second_node = subprocess.Popen(["bash", "-c", line], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        result = train.run(nodes)
        output, _ = second_node.communicate(timeout=300)
    finally:
        if second_node.poll() is None:
            second_node.kill()
    assert second_node.returncode == 0, output[-3000:]
    assert f"[train] node 1 of 2, run on that node: {line}" in capfd.readouterr().out
    assert result.values["world_size"] == 2 and result.values["complete"]
    assert (nodes.output_path / "train" / "torchrun-node0.log").is_file()
    assert close(losses(one), losses(nodes)), (losses(one), losses(nodes))
    for name, value in exported(one).items():
        torch.testing.assert_close(exported(nodes)[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_several_nodes_need_a_rendezvous_and_each_gets_its_command(base_run) -> None:
    from contract.config import TrainerDeployment

    with pytest.raises(ValueError, match="nnodes 2 needs rdzv_endpoint"):
        TrainerDeployment(nnodes=2)
    with pytest.raises(ValueError, match="node_rank 3 must be below nnodes 3"):
        TrainerDeployment(nnodes=3, node_rank=3, rdzv_endpoint="head:29400")
    trainer = TrainerDeployment(nnodes=3, node_rank=1, nproc_per_node=2, rdzv_endpoint="head:29400")
    cfg = base_run.model_copy(update={"deployment": base_run.deployment.model_copy(update={"trainer": trainer})})
    commands = other_node_commands(cfg, "parent123")
    assert sorted(commands) == [0, 2] and trainer.world_size == 6
    for node, line in commands.items():
        assert line.startswith(f"cd {Path.cwd()} && EAGLET_PARENT_RUN_ID=parent123 ")
        assert f"--nnodes=3 --nproc_per_node=2 --node_rank={node} --rdzv_backend=c10d --rdzv_endpoint=head:29400" in line
        assert f"--rdzv_id={cfg.run_id} -m tasks.train --config {cfg.output_path.resolve()}/train/launch.yaml" in line


def test_capture_stage_writes_no_shards_for_online_training(base_run, tmp_path: Path) -> None:
    from tasks import capture

    cfg = fresh(base_run, tmp_path, "online-capture", mode="online")
    result = capture.run(cfg)
    assert result.manifest["online"] is True
    assert result.shards_written == [] and result.shards_kept == [], "online training reads no shard"
    assert result.manifest["splits"]["train"]["records"] == len(FeatureSet(base_run.output_path / "features", "train"))
    assert (cfg.output_path / "vocab" / "vocab_mapping.safetensors").is_file()
    assert result.report.ok + result.report.error + result.report.skipped == result.report.input


def test_eaglet_train_continues_a_halted_run(base_run, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from flows.cli import app

    cfg = fresh(base_run, tmp_path, "cli", max_steps=6, halt_after=3)
    config = tmp_path / "cli.yaml"
    config.write_text(json.dumps(cfg.model_dump(mode="json")))
    halted = CliRunner().invoke(app, ["train", "--config", str(config)])
    assert halted.exit_code == 0, halted.output
    assert len(losses(cfg)) == 3
    retired = CliRunner().invoke(app, ["train", "--config", str(config), "--resume"])
    assert retired.exit_code == 2 and "No such option: --resume" in retired.output, retired.output
    finished = CliRunner().invoke(app, ["train", "--config", str(config), "training.resume_from=auto",
                                        "training.halt_after=null"])
    assert finished.exit_code == 0, finished.output
    assert sorted(losses(cfg)) == [1, 2, 3, 4, 5, 6]
