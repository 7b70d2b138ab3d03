"""train stage on captured tiny-target features: learning, exact resume, refusals, NaN, and two ranks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from flows.cli import app
from models.vocab_mapping import write_safetensors_file
from tasks import train
from models.target_heads import load_target_heads
from models.teacher import Teacher
from tasks.features.shards import FeatureSet
from tasks.training.checkpoint import ResumeRefused, training_code_fingerprint
from training_run import copied_run


@pytest.fixture(scope="module")
def base_run(captured_tiny_run):
    """The session's captured run: every test trains in a copy of it (`fresh`)."""
    return captured_tiny_run


def fresh(base_run, tmp_path: Path, name: str, **training):
    return copied_run(base_run, tmp_path / name, **training)


def losses(cfg) -> dict[int, float]:
    rows = [json.loads(line) for line in (cfg.output_path / "train" / "steps.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def weights(cfg, engine: str = "sglang") -> dict[str, torch.Tensor]:
    return load_file(str(cfg.output_path / "draft" / engine / "model.safetensors"))


def test_training_improves_acceptance_and_exports_the_draft(base_run, tmp_path: Path) -> None:
    cfg = fresh(base_run, tmp_path, "run")
    result = train.run(cfg)
    summary = result.values
    assert summary["complete"] and summary["steps"] == summary["total_steps"] > 10
    # Measured on held-out records (training_run.HELD_OUT_QUESTIONS): acc_0 0.64, simulated accept length 1.11
    # against 0.0 untrained. Training must lift the prompts it never saw well above the untrained draft.
    assert summary["eval_simulated_accept_len"] > summary["untrained_simulated_accept_len"] + 0.5, summary
    assert summary["eval_acc_0"] > 0.4, summary
    features = FeatureSet(cfg.output_path / "features", "train")
    records = [features[index] for index in range(len(features))]
    share = sum(int(record["loss_mask"].sum()) for record in records) / sum(len(record["input_ids"]) for record in records)
    assert summary["supervised_share"] == pytest.approx(share), "every epoch sees each record once: the same share"
    for engine in ("sglang", "vllm"):
        config = json.loads((cfg.output_path / "draft" / engine / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (cfg.output_path / "train" / "accuracy_by_depth.png").is_file()
    assert len(losses(cfg)) == summary["steps"]
    kept = sorted(path.name for path in (cfg.output_path / "checkpoints").glob("step-*"))
    best = json.loads((cfg.output_path / "checkpoints" / "best.json").read_text())["checkpoint"]
    assert len(kept) <= cfg.training.keep_last + 1 and best in kept and kept[-1] == f"step-{int(summary['steps']):08d}"


def test_halt_and_resume_is_bit_identical_to_a_straight_run(base_run, tmp_path: Path) -> None:
    """With noise on the hidden states and dropout too: their generator's state is part of the checkpoint."""
    straight = fresh(base_run, tmp_path, "straight", hidden_noise_std=0.05, dropout=0.1)
    train.run(straight)
    halted = fresh(base_run, tmp_path, "halted", halt_after=9, hidden_noise_std=0.05, dropout=0.1)
    first = train.run(halted)
    assert not first.values["complete"] and first.values["steps"] == 9
    resumed = train.run(halted.model_copy(update={"training": halted.training.model_copy(update={"halt_after": None, "resume_from": "auto"})}))
    assert resumed.values["complete"]
    expected, actual = weights(straight), weights(halted)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)
    assert losses(halted) == losses(straight)


def test_a_shard_aware_plan_trains_and_resumes_exactly(base_run, tmp_path: Path) -> None:
    """One shard per shuffle group (training.shuffle_buffer_shards 1): another order than the plain shuffle, and a
    halted run resumes it from the cursor bit-exactly."""
    plain = fresh(base_run, tmp_path, "plain", max_steps=8)
    train.run(plain)
    straight = fresh(base_run, tmp_path, "straight", shuffle_buffer_shards=1, max_steps=8)
    train.run(straight)
    assert losses(straight) != losses(plain), "the shard-aware plan is another order"
    halted = fresh(base_run, tmp_path, "halted", shuffle_buffer_shards=1, max_steps=8, halt_after=3)
    train.run(halted)
    resumed = train.run(halted.model_copy(update={"training": halted.training.model_copy(update={"halt_after": None, "resume_from": "auto"})}))
    assert resumed.values["complete"] and losses(halted) == losses(straight)
    assert all(torch.equal(weights(straight)[name], weights(halted)[name]) for name in weights(straight))


def test_a_checkpoint_that_does_not_record_the_shuffle_is_refused(base_run, tmp_path: Path) -> None:
    """A checkpoint whose math lacks `training.shuffle` says nothing of the order it was trained in, so no run
    continues it (not even under the plain shuffle): the refusal names the field."""
    halted = fresh(base_run, tmp_path, "halted", max_steps=6, halt_after=3)
    train.run(halted)
    (checkpoint,) = [path for path in (halted.output_path / "checkpoints").glob("step-*")]
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["math"].pop("training.shuffle") == "plain"
    state_file.write_text(json.dumps(state))
    with pytest.raises(ResumeRefused, match=r"training.shuffle: checkpoint not recorded, run 'plain'"):
        train.run(halted.model_copy(update={"training": halted.training.model_copy(update={"halt_after": None})}))
    assert (checkpoint / "trainer_state.json").is_file(), "the refused checkpoint is kept"


def test_dropout_acts_in_training_only(base_run, tmp_path: Path) -> None:
    """training.dropout changes the training steps; the held-out evaluation runs the layer without it."""
    from safetensors.torch import load_file as read_weights

    plain = fresh(base_run, tmp_path, "plain", max_steps=4)
    dropped = fresh(base_run, tmp_path, "dropped", max_steps=4, dropout=0.3)
    train.run(plain)
    result = train.run(dropped)
    assert losses(plain)[1] != losses(dropped)[1]
    summary = json.loads((dropped.output_path / "train" / "summary.json").read_text())
    checkpoint = dropped.output_path / "checkpoints" / "step-00000004" / "draft.safetensors"
    draft = train.build_draft(dropped, load_target_heads(dropped.output_path / "target"),
                              json.loads((dropped.output_path / "features" / "manifest.json").read_text()),
                              torch.device("cpu"))
    draft.load_state_dict(read_weights(str(checkpoint)), strict=False)
    assert draft.midlayer.dropout.p == 0.3 and draft.training
    teacher = Teacher(load_target_heads(dropped.output_path / "target").lm_head, draft.t2d, torch.float32)
    eval_set = FeatureSet(dropped.output_path / "features", "eval")
    first = train.evaluate_features(draft, eval_set, teacher, dropped.training.ttt_length)
    second = train.evaluate_features(draft, eval_set, teacher, dropped.training.ttt_length)
    assert first == second and draft.training, "no dropout in evaluation, and the draft's mode is restored"
    assert first["acc_0"] == pytest.approx(result.values["eval_acc_0"]) and summary["eval_acc_0"] == result.values["eval_acc_0"]


def test_resume_with_another_ttt_length_is_refused(base_run, tmp_path: Path) -> None:
    cfg = fresh(base_run, tmp_path, "run", max_steps=4)
    train.run(cfg)
    changed = cfg.model_copy(update={"training": cfg.training.model_copy(update={"ttt_length": 2, "resume_from": "auto"})})
    with pytest.raises(ResumeRefused, match="training.ttt_length: checkpoint 3, run 2"):
        train.run(changed)


def test_nan_loss_stops_with_the_step_and_records(base_run, tmp_path: Path) -> None:
    cfg = fresh(base_run, tmp_path, "poisoned")
    shard = cfg.output_path / "features" / "train" / "shard-00000.safetensors"
    from safetensors import safe_open

    with safe_open(str(shard), "pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    tensors["aux_hidden_state"][0, 0] = float("nan")
    size = shard.stat().st_size
    write_safetensors_file(shard, tensors, metadata)
    assert shard.stat().st_size == size, "same layout, only a value changed"
    with pytest.raises(train.TrainingDiverged, match=r"at step \d+ \(records .*chats:"):
        train.run(cfg)
    config = tmp_path / "poisoned.yaml"
    config.write_text(json.dumps(cfg.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["stage", "train", "--config", str(config)])
    assert result.exit_code == 1 and "loss is not finite" in result.output


@pytest.mark.integration
def test_two_ranks_match_one_and_resume_exactly(base_run, tmp_path: Path) -> None:
    one = fresh(base_run, tmp_path, "one")
    single_summary = train.run(one).values
    two = fresh(base_run, tmp_path, "two")
    two = two.model_copy(update={"deployment": two.deployment.model_copy(update={"trainer": two.deployment.trainer.model_copy(update={"nproc_per_node": 2})})})
    result = train.run(two)
    assert result.values["world_size"] == 2 and result.values["complete"]
    # each rank evaluated its share of the eval records (gloo all-reduce of the counts): one rank's metrics
    evaluated = [key for key in single_summary if key.startswith(("eval_", "untrained_"))]
    assert evaluated and all(result.values[key] == pytest.approx(single_summary[key], abs=1e-5) for key in evaluated)
    single, double = losses(one), losses(two)
    assert single.keys() == double.keys()
    assert all(abs(single[step] - double[step]) < 1e-5 for step in single), (single, double)

    halted = fresh(base_run, tmp_path, "two-halted", halt_after=7)
    halted = halted.model_copy(update={"deployment": two.deployment})
    train.run(halted)
    train.run(halted.model_copy(update={"training": halted.training.model_copy(update={"halt_after": None, "resume_from": "auto"})}))
    assert all(torch.equal(weights(two)[name], weights(halted)[name]) for name in weights(two))


def test_a_frozen_lm_head_stays_the_targets_rows(base_run, tmp_path: Path) -> None:
    """training.freeze_lm_head keeps the head the draft starts from (the target's rows of the draft vocabulary)
    while the rest learns; it is a math field, so a run with the other setting cannot resume from it."""
    from models.target_heads import load_target_heads
    from models.vocab_mapping import load_vocab_mapping

    cfg = fresh(base_run, tmp_path, "frozen", freeze_lm_head=True, max_steps=6)
    train.run(cfg)
    vocab = load_vocab_mapping(cfg.output_path / "vocab" / "vocab_mapping.safetensors")
    rows = load_target_heads(cfg.output_path / "target").lm_head[torch.arange(vocab.draft_vocab_size) + vocab.d2t]
    exported = weights(cfg)
    assert torch.equal(exported["lm_head.weight"], rows.to(exported["lm_head.weight"].dtype))
    moving = fresh(base_run, tmp_path, "moving", max_steps=6)
    train.run(moving)
    assert not torch.equal(weights(moving)["lm_head.weight"], exported["lm_head.weight"])
    changed = cfg.model_copy(update={"training": cfg.training.model_copy(update={"freeze_lm_head": False,
                                                                                 "resume_from": "auto"})})
    with pytest.raises(ResumeRefused, match="training.freeze_lm_head"):
        train.run(changed)


def test_a_rerun_continues_by_default_and_a_math_change_keeps_the_checkpoints(base_run, tmp_path: Path) -> None:
    """`training.resume_from: auto`: a rerun (here with another eval interval) continues the finished run instead
    of deleting it; a run with other math is refused naming the field and the ways on, and deletes nothing;
    `resume_from: none` starts over after moving the old run to checkpoints.superseded-<time>/."""
    cfg = fresh(base_run, tmp_path, "auto", max_steps=4)
    train.run(cfg)
    step_log = (cfg.output_path / "train" / "steps.jsonl").read_text()
    checkpoints = sorted(path.name for path in (cfg.output_path / "checkpoints").iterdir())
    rerun = cfg.model_copy(update={"training": cfg.training.model_copy(update={"eval_interval": 3})})
    assert train.run(rerun).values["complete"]
    assert (cfg.output_path / "train" / "steps.jsonl").read_text() == step_log, "no step was trained again"

    other_math = cfg.model_copy(update={"training": cfg.training.model_copy(update={"learning_rate": 1e-3})})
    with pytest.raises(ResumeRefused, match=r"(?s)training.learning_rate: checkpoint 0.003, run 0.001.*resume_from=none"):
        train.run(other_math)
    assert sorted(path.name for path in (cfg.output_path / "checkpoints").iterdir()) == checkpoints
    assert not list(cfg.output_path.glob("checkpoints.superseded-*"))

    over = other_math.model_copy(update={"training": other_math.training.model_copy(update={"resume_from": "none"})})
    assert train.run(over).values["complete"]
    superseded = list(cfg.output_path.glob("checkpoints.superseded-*"))
    assert len(superseded) == 1
    assert sorted(path.name for path in (superseded[0] / "checkpoints").iterdir()) == checkpoints
    assert (superseded[0] / "steps.jsonl").read_text() == step_log
    assert (superseded[0] / "draft" / "sglang" / "model.safetensors").is_file()
    assert len(losses(over)) == 4, "the new run's log holds only its own steps"


def test_auto_does_not_continue_a_run_that_other_code_wrote(base_run, tmp_path: Path, monkeypatch, capsys) -> None:
    """A code change reruns the train stage (DVC, the flow's cache); `auto` must then train anew instead of
    handing back the finished run of the old code. A checkpoint path given explicitly is still continued."""
    cfg = fresh(base_run, tmp_path, "code", max_steps=4)
    train.run(cfg)
    first = json.loads((cfg.output_path / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    assert first["code"] == training_code_fingerprint()
    monkeypatch.setattr(train, "training_code_fingerprint", lambda: "changed-code")
    assert train.run(cfg).values["complete"]
    assert "step-00000004 was written by other code" in capsys.readouterr().out
    superseded = list(cfg.output_path.glob("checkpoints.superseded-*"))
    assert len(superseded) == 1 and (superseded[0] / "checkpoints" / "step-00000004").is_dir()
    assert len(losses(cfg)) == 4, "every step was trained again"
    again = json.loads((cfg.output_path / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
    assert again["code"] == "changed-code"

    monkeypatch.setattr(train, "training_code_fingerprint", lambda: "later-code")
    longer = cfg.model_copy(update={"training": cfg.training.model_copy(update={
        "max_steps": None, "resume_from": str(cfg.output_path / "checkpoints" / "step-00000004")})})
    with pytest.raises(ResumeRefused, match="training.max_steps"):
        train.run(longer)  # an explicit path skips the code check, never the math check
    same_math = longer.model_copy(update={"training": longer.training.model_copy(update={"max_steps": 4})})
    assert train.run(same_math).values["steps"] == 4
    assert not list(cfg.output_path.glob("checkpoints.superseded-*"))[1:], "continued, not set aside"


def test_a_killed_run_resumes_without_repeating_steps_in_the_log_or_in_mlflow(base_run, tmp_path: Path,
                                                                             mlflow_uri: str) -> None:
    """Steps logged after the last checkpoint (a kill before the next save) are trained again on resume: the step
    log is cut back to the checkpoint, and the resumed MLflow run holds every step exactly once."""
    import mlflow

    cfg = fresh(base_run, tmp_path, "killed", save_interval=2, halt_after=3, max_steps=6)
    cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"enabled": True, "tracking_uri": mlflow_uri})})
    train.run(cfg)
    shutil.rmtree(cfg.output_path / "checkpoints" / "step-00000003")  # killed after logging step 3, before saving it
    assert list(losses(cfg)) == [1, 2, 3]
    resumed = train.run(cfg.model_copy(update={"training": cfg.training.model_copy(update={"halt_after": None})}))
    assert resumed.values["complete"] and resumed.values["steps"] == 6
    rows = [json.loads(line)["step"] for line in (cfg.output_path / "train" / "steps.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3, 4, 5, 6]
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([experiment.experiment_id], "tags.`eaglet.stage` = 'train'", order_by=["attribute.start_time DESC"])
    history = client.get_metric_history(runs[0].info.run_id, "train.loss")
    assert sorted(metric.step for metric in history) == [1, 2, 3, 4, 5, 6]


def test_the_engine_exports_are_replaced_together_or_not_at_all(base_run, tmp_path: Path, monkeypatch) -> None:
    """A failure while writing the second engine's export leaves both previous exports as they were."""
    import models.draft_checkpoint as draft_checkpoint
    from models.target_heads import load_target_heads
    from tasks.training.outputs import export

    cfg = fresh(base_run, tmp_path, "exports", max_steps=2)
    train.run(cfg)
    exported = {engine: weights(cfg, engine) for engine in ("sglang", "vllm")}
    manifest = json.loads((cfg.output_path / "features" / "manifest.json").read_text())
    untrained = train.build_draft(cfg, load_target_heads(cfg.output_path / "target"), manifest, torch.device("cpu"))
    real_save = draft_checkpoint.save_pretrained

    def disk_full_on_vllm(draft, directory, contract, num_target_layers, engine=None, **options):
        if engine == "vllm":
            raise OSError("No space left on device")
        return real_save(draft, directory, contract, num_target_layers, engine=engine, **options)

    monkeypatch.setattr(draft_checkpoint, "save_pretrained", disk_full_on_vllm)
    with pytest.raises(OSError, match="No space left"):
        export(cfg, untrained, manifest, 0, 1, {}, "float32")
    for engine, before in exported.items():
        after = weights(cfg, engine)
        assert all(torch.equal(before[name], after[name]) for name in before), engine
    assert not [path.name for path in cfg.output_path.iterdir() if path.name.startswith(".draft")]


def test_switching_to_online_training_keeps_the_offline_shards(base_run, tmp_path: Path) -> None:
    from tasks import capture

    cfg = fresh(base_run, tmp_path, "modes")
    shards = sorted(path.name for path in (cfg.output_path / "features" / "train").glob("shard-*"))
    online = cfg.model_copy(update={"training": cfg.training.model_copy(update={"mode": "online"})})
    capture.run(online)
    assert sorted(path.name for path in (cfg.output_path / "features" / "train").glob("shard-*")) == shards
    back = capture.run(cfg)
    assert back.shards_written == [] and len(back.shards_kept) >= len(shards)
