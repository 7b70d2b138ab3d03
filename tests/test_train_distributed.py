"""The trainer on a multi-GPU node: the eval sharded across ranks, the process group's timeout, rank 0's end of a
run after the last collective, the CUDA generators in the checkpoint, and the pinned flash-attn of `eaglet[cuda]`."""

from __future__ import annotations

import json
import tomllib
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError
from safetensors.torch import load_file

from contract.config import RunConfig
from models.target_heads import load_target_heads
from models.teacher import Teacher
from tasks import train
from tasks.features.shards import FeatureSet
from tasks.training import parallel
from tasks.training.batch_plan import Cursor, rank_share
from tasks.training.checkpoint import TrainerState, load_checkpoint, rng_state, save_checkpoint
from tasks.training.outputs import training_tracker
from training_run import copied_run

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trained(captured_tiny_run, tmp_path_factory: pytest.TempPathFactory) -> RunConfig:
    """A copy of the session's captured run, trained 4 steps in this process (fp32 on CPU)."""
    cfg = copied_run(captured_tiny_run, tmp_path_factory.mktemp("distributed") / "run", max_steps=4)
    train.run(cfg)
    return cfg


def trained_draft(cfg: RunConfig) -> train.DraftModel:
    """The draft of `cfg`'s last checkpoint, rebuilt as the trainer builds it."""
    manifest = json.loads((cfg.output_path / "features" / "manifest.json").read_text())
    draft = train.build_draft(cfg, load_target_heads(cfg.output_path / "target"), manifest, torch.device("cpu"))
    draft.load_state_dict(load_file(str(cfg.output_path / "checkpoints" / "step-00000004" / "draft.safetensors")),
                          strict=False)
    return draft


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_the_ranks_shares_of_the_eval_add_up_to_one_rank_over_every_record(trained: RunConfig, world_size: int) -> None:
    """Each rank evaluates records rank, rank + N, ...; the all-reduce sums their counts (the element-wise sum below,
    as all_reduce SUM computes it), and the metrics of the sum equal one rank's eval of every record. 6 records over
    4 or 8 ranks: shares of unequal size, some empty."""
    draft = trained_draft(trained)
    teacher = Teacher(load_target_heads(trained.output_path / "target").lm_head, draft.t2d, torch.float32,
                      outside_mass=True)
    records = FeatureSet(trained.output_path / "features", "train")
    steps = trained.training.ttt_length
    one_rank = train.evaluate_features(draft, records, teacher, steps)
    positions = list(range(len(records)))
    shares = [train.eval_totals(draft, records, teacher, steps, rank_share(positions, rank, world_size)).flat()
              for rank in range(world_size)]
    summed = [sum(values) for values in zip(*shares)]
    sharded = train.EvalTotals.from_flat(summed, steps).metrics()
    assert sharded.keys() == one_rank.keys()
    assert sharded == pytest.approx(one_rank, rel=1e-12, abs=1e-12)
    assert one_rank["acc_0"] > 0.0, "a trained draft: the metrics compared are not all zero"


def test_the_process_group_waits_as_long_as_the_config_says() -> None:
    """init_process_group gets training.collective_timeout_s (default 30 minutes, not NCCL's 10), gloo on CPU and
    nccl on GPU; a timeout of zero is refused."""
    default = RunConfig()
    assert default.training.collective_timeout_s == 1800.0
    assert parallel.process_group_options(torch.device("cpu"), default.training.collective_timeout_s) == {
        "backend": "gloo", "timeout": timedelta(minutes=30)}
    longer = RunConfig.model_validate({"training": {"collective_timeout_s": 5400}})
    assert parallel.process_group_options(torch.device("cuda", 3), longer.training.collective_timeout_s) == {
        "backend": "nccl", "timeout": timedelta(minutes=90)}
    with pytest.raises(ValidationError, match="collective_timeout_s"):
        RunConfig.model_validate({"training": {"collective_timeout_s": 0}})


def test_rank_zero_publishes_the_run_with_no_process_group(trained: RunConfig, tmp_path: Path, mlflow_uri: str) -> None:
    """The end of a two-rank run as rank 0 runs it after leaving the process group: the exports, the summary and
    the MLflow uploads happen with no group at all (any collective among them would raise here)."""
    import mlflow

    cfg = copied_run(trained, tmp_path / "run", max_steps=4)
    cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"enabled": True,
                                                                             "tracking_uri": mlflow_uri})})
    state = TrainerState(step=4, cursor=Cursor(), math={}, scheduler={}, eval_metrics={"acc_0": 0.5, "acc_1": 0.25,
                         "acc_2": 0.125, "simulated_accept_len": 1.7}, code="")
    ending = train.Ending(cfg, trained_draft(trained), state, total_steps=4, world_size=2,
                          manifest=json.loads((cfg.output_path / "features" / "manifest.json").read_text()),
                          precision="float32", history=[], before={})
    assert not dist.is_initialized()
    with training_tracker(cfg, parallel.Distributed(rank=0, world_size=2)) as tracker:
        result = train.publish(ending, tracker)
    assert result.values["world_size"] == 2 and result.values["complete"] and result.values["eval_acc_0"] == 0.5
    assert (cfg.output_path / "draft" / "sglang" / "model.safetensors").is_file()
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([experiment.experiment_id], "tags.`eaglet.stage` = 'train'")
    uploaded = {item.path for item in client.list_artifacts(run.info.run_id, "draft")}
    assert uploaded == {"draft/sglang", "draft/vllm"}
    assert [item.path for item in client.list_artifacts(run.info.run_id, "train")] == ["train/accuracy_by_depth.png"]


def test_the_checkpoint_holds_a_cuda_generator_slot_and_resume_restores_it(tmp_path: Path) -> None:
    """Each rank's RNG file has a `cuda` entry (one state per visible GPU; empty on a CPU host), written as JSON
    and read back by load_checkpoint, which restores the generators: the noise after the resume is the noise
    after the save. A checkpoint written before the slot existed still loads."""
    torch.manual_seed(7)
    saved = rng_state()
    assert saved["cuda"] == ([state.tolist() for state in torch.cuda.get_rng_state_all()]
                             if torch.cuda.is_available() else [])
    state = TrainerState(step=1, cursor=Cursor(), math={}, scheduler={}, eval_metrics={})
    directory = save_checkpoint(tmp_path / "checkpoints", {"weight": torch.ones(2)}, {}, state, [saved], "{}\n")
    written = json.loads((directory / "rng-rank0.json").read_text())
    assert written["cuda"] == saved["cuda"]
    expected = torch.randn(5)
    load_checkpoint(directory, 0)
    assert torch.equal(torch.randn(5), expected)
    del written["cuda"]  # as written before the slot existed
    (directory / "rng-rank0.json").write_text(json.dumps(written))
    load_checkpoint(directory, 0)
    assert torch.equal(torch.randn(5), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA generators exist only where a CUDA GPU is visible")
def test_cuda_noise_and_dropout_are_identical_after_a_resume(tmp_path: Path) -> None:
    """The hidden-state noise and dropout a GPU run draws after a checkpoint are drawn again after resuming it."""
    torch.manual_seed(11)
    torch.randn(64, device="cuda")  # the generator moved on from its seed
    state = TrainerState(step=1, cursor=Cursor(), math={}, scheduler={}, eval_metrics={})
    directory = save_checkpoint(tmp_path / "checkpoints", {"weight": torch.ones(2)}, {}, state, [rng_state()], "{}\n")
    ones = torch.ones(256, device="cuda")
    expected = (torch.randn(256, device="cuda"), torch.nn.functional.dropout(ones, 0.3))
    torch.randn(1024, device="cuda")  # the steps after the checkpoint that a preemption loses
    load_checkpoint(directory, 0)
    assert torch.equal(torch.randn(256, device="cuda"), expected[0])
    assert torch.equal(torch.nn.functional.dropout(ones, 0.3), expected[1])


def test_the_cuda_extra_pins_flash_attn_to_one_release() -> None:
    """`eaglet[cuda]` names an exact flash-attn release (one with prebuilt wheels for the pinned torch), so pip never
    picks a newer source release and compiles it; the prebuilt wheel's local version (+cu...torch2.13) satisfies it."""
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert "torch==2.13.0" in project["dependencies"]
    (flash,) = [Requirement(entry) for entry in project["optional-dependencies"]["cuda"]
                if Requirement(entry).name == "flash-attn"]
    (pin,) = list(flash.specifier)
    assert pin.operator == "==" and pin.version == "2.8.3", flash
    assert flash.specifier.contains("2.8.3+cu130torch2.13") and not flash.specifier.contains("2.8.3.post2")
