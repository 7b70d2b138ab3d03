"""capture.backend vllm: the vLLM CPU build (`make serve-env`) computes the states, eaglet writes the same shards.

The engine is started by the stage with our hidden-states connector; the shards are compared with local capture's
on the tiny target, and a planted off-by-one layer numbering must fail the in-process verification.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from contract.config import RunConfig
from flows.preflight import engine_problems
from models.target_capture import every_layer_output
from models.target_heads import load_target_heads
from models.target_loading import load_target
from tasks import capture, target, train
from tasks.features import engine_states
from tasks.features.engine_check import TOLERANCE, verification_sample
from tasks.features.engine_states import (CAPTURE_URL_VARIABLE, EngineCaptureError, EngineStates, HeadModel,
                                          checked_states, engine_layer_ids, final_norm)
from tasks.features.online import OnlineFeatures
from tasks.features.preparation import Sample
from tasks.features.shards import FeatureSet
from tasks.features.state_sources import LocalStates
from tasks.serving.engine import free_port
from test_capture import AUX, EVAL, SKIPPED, TRAIN, make_run
from test_train_modes import losses
from training_run import copied_run, copy_run

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
NUM_LAYERS = 6


def engine_run(tmp_path: Path, tiny_target_dir: Path, **capture_settings) -> RunConfig:
    """The tiny run of test_capture with the vLLM backend on a free port, all cores for the engine."""
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"the vLLM engine environment is missing ({VLLM_PYTHON}): run `make serve-env`")
    cfg = make_run(tmp_path, tiny_target_dir, backend="vllm", engine_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
                   **capture_settings)
    cfg.runtime.engines["vllm"].port = free_port()
    return cfg


@pytest.mark.usefixtures("vllm_python")
def test_vllm_capture_writes_the_shards_local_capture_writes(tmp_path: Path, tiny_target_dir: Path) -> None:
    local = capture.run(make_run(tmp_path / "local", tiny_target_dir, dtype="float32"))
    cfg = engine_run(tmp_path / "vllm", tiny_target_dir, dtype="float32", verify_fraction=0.5)
    served = capture.run(cfg)

    assert served.report.ok == local.report.ok == len(TRAIN) + len(EVAL) - len(SKIPPED)
    assert {o.id for o in served.report.outcomes if o.status == "skipped"} == SKIPPED
    for split in ("train", "eval"):
        engine_rows = list(FeatureSet(served.features_dir, split, verify=True))
        local_rows = list(FeatureSet(local.features_dir, split, verify=True))
        assert [row["id"] for row in engine_rows] == [row["id"] for row in local_rows]
        for engine_row, local_row in zip(engine_rows, local_rows):
            assert torch.equal(engine_row["input_ids"], local_row["input_ids"])
            assert torch.equal(engine_row["loss_mask"], local_row["loss_mask"])
            for name in ("aux_hidden_state", "hidden_state"):
                assert engine_row[name].shape == local_row[name].shape
                assert torch.allclose(engine_row[name], local_row[name], rtol=1e-4, atol=1e-4), (split, name)

    producer = served.manifest["producer"]
    assert producer["backend"] == "vllm" and producer["version"].startswith("0.32")
    assert producer["engine_layer_ids"] == [layer + 1 for layer in AUX] + [NUM_LAYERS], "vLLM numbers layer i as i+1"
    assert producer["dtype"] == "float32"
    verify = producer["verify"]
    assert len(verify["records"]) == 4, "half of the 7 captured records, evenly spaced"
    slots = {slot["slot"]: slot for slot in verify["slots"]}
    assert set(slots) == {"aux 0", "aux 1", "aux 2", "last layer", "final (normed)"}
    assert [slots[f"aux {i}"]["expected_layer"] for i in range(3)] == AUX
    assert all(0.0 <= slot["max_relative_difference"] < TOLERANCE["float32"] for slot in slots.values()), slots
    assert local.manifest["producer"]["backend"] == "local"
    assert not (served.features_dir / ".engine-states").exists(), "every state file is deleted once read"
    assert "extract_hidden_states" in (cfg.output_path / "logs" / "capture-vllm.log").read_text()

    rerun = capture.run(cfg)
    assert rerun.shards_written == [] and rerun.manifest["producer"]["verify"] == verify, "kept shards keep their producer"


@pytest.mark.usefixtures("vllm_python")
def test_vllm_capture_of_the_embedded_smollm2_passes_the_verification(tmp_path: Path, embedded_target: Path) -> None:
    """The real target (30 layers, tied embeddings): every captured record re-captured in-process."""
    cfg = engine_run(tmp_path / "vllm", embedded_target, dtype="float32", verify_fraction=1.0, aux_layer_ids=[1, 14, 26])
    served = capture.run(cfg)
    assert served.report.ok == len(TRAIN) + len(EVAL) - len(SKIPPED)
    producer = served.manifest["producer"]
    assert producer["engine_layer_ids"] == [2, 15, 27, 30]
    verify = producer["verify"]
    assert len(verify["records"]) == served.report.ok
    slots = {slot["slot"]: slot for slot in verify["slots"]}
    assert [slots[f"aux {i}"]["expected_layer"] for i in range(3)] == [1, 14, 26]
    assert all(0.0 <= slot["max_relative_difference"] < TOLERANCE["float32"] for slot in slots.values()), slots


@pytest.mark.usefixtures("vllm_python")
def test_an_off_by_one_layer_numbering_fails_the_verification(tmp_path: Path, tiny_target_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = engine_run(tmp_path, tiny_target_dir, verify_fraction=0.1)
    monkeypatch.setattr(engine_states, "vllm_layer_id", lambda layer: layer)  # HF's numbering sent unconverted
    with pytest.raises(EngineCaptureError) as raised:
        capture.run(cfg)
    message = str(raised.value)
    assert message.startswith("record ") and "engine slot 'aux 0' (vLLM layer id 1)" in message
    assert "matches decoder layer 0 best" in message and f"not layer {AUX[0]}" in message
    assert not (cfg.output_path / "features" / "manifest.json").exists(), "unverified features are not finished"


def test_the_engine_slots_become_local_captures_features(tiny_target_dir: Path) -> None:
    """The conversion half without an engine: raw layer outputs as the engine stores them, normed and fused here,
    equal the in-process capture; the lm_head alone equals the target's."""
    model, _ = load_target(tiny_target_dir)
    ids = [5, 17, 42, 99, 3, 250]
    layers, normed = every_layer_output(model, ids)
    heads = load_target_heads(tiny_target_dir)
    source = EngineStates("http://unused", "target", engine_layer_ids(AUX, NUM_LAYERS),
                          final_norm(tiny_target_dir, heads.final_norm), HeadModel(heads.lm_head), 4)
    raw = torch.stack([layers[layer] for layer in [*AUX, NUM_LAYERS - 1]], dim=1)
    aux, hidden = source.split(raw)
    assert torch.equal(aux, torch.cat([layers[layer] for layer in AUX], dim=-1))
    assert torch.allclose(hidden, normed, atol=1e-6)
    with torch.no_grad():
        assert torch.allclose(source.head_model().get_output_embeddings()(hidden),
                              model.get_output_embeddings()(normed), atol=1e-5)


def test_a_state_file_for_other_tokens_is_refused_naming_the_record() -> None:
    sample = Sample("train.jsonl:3", "chat:x", [1, 2, 3, 4], [0, 0, 1, 1])
    states = torch.zeros(4, 4, 8)
    assert checked_states(sample, {"token_ids": torch.tensor([1, 2, 3, 4]), "hidden_states": states}, 4) is states
    with pytest.raises(EngineCaptureError, match=r"record chat:x \(train.jsonl:3\).*4 sent; they differ from position 2"):
        checked_states(sample, {"token_ids": torch.tensor([1, 2, 9, 4]), "hidden_states": states}, 4)
    with pytest.raises(EngineCaptureError, match=r"chat:x .*shape \(4, 3, 8\), expected \[4, 4, hidden\]"):
        checked_states(sample, {"token_ids": torch.tensor([1, 2, 3, 4]), "hidden_states": torch.zeros(4, 3, 8)}, 4)


def test_verification_sample_is_evenly_spaced_and_never_empty() -> None:
    samples = [Sample(f"train.jsonl:{n}", f"r{n}", [n], [1]) for n in range(10)]
    assert [s.id for s in verification_sample(samples, 0.3)] == ["r0", "r3", "r6"]
    assert [s.id for s in verification_sample(samples, 0.01)] == ["r0"]
    assert verification_sample(samples, 0.0) == [] and len(verification_sample(samples, 1.0)) == 10


@pytest.mark.usefixtures("vllm_python")
def test_online_training_takes_its_features_from_the_engine(tmp_path: Path, captured_tiny_run: RunConfig) -> None:
    """training.mode online with capture.backend vllm: the train stage starts the engine, a producer thread streams
    the coming micro-batches from it, and the run equals online training on the in-process target."""
    base = copied_run(captured_tiny_run, tmp_path / "base", max_steps=6)

    def online(name: str, **capture_settings) -> RunConfig:
        copy_run(base.output_path, tmp_path / name)
        return base.model_copy(update={"output_dir": str(tmp_path / name),
                                       "training": base.training.model_copy(update={"mode": "online"}),
                                       "capture": base.capture.model_copy(update=capture_settings)})

    local = online("local")
    local_result = train.run(local)
    engine_cfg = online("engine", backend="vllm", engine_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    engine_cfg.runtime.engines["vllm"].port = free_port()
    engine_result = train.run(engine_cfg)

    assert engine_result.values["complete"] and engine_result.values["steps"] == local_result.values["steps"] == 6
    assert "data_wait_share" in engine_result.values
    engine_losses, local_losses = losses(engine_cfg), losses(local)
    assert engine_losses.keys() == local_losses.keys()
    assert all(abs(engine_losses[step] - local_losses[step]) < 1e-4 for step in local_losses), (engine_losses, local_losses)
    assert "extract_hidden_states" in (engine_cfg.output_path / "logs" / "train-capture-vllm.log").read_text()
    assert CAPTURE_URL_VARIABLE not in os.environ and not (engine_cfg.output_path / "train" / ".engine-states").exists()


def test_the_online_stream_hands_out_batches_in_order_and_computes_the_rest(tiny_target_dir: Path) -> None:
    model, _ = load_target(tiny_target_dir)
    samples = [Sample(f"train.jsonl:{n}", f"r{n}", [5 + n, 17, 42, 99][: 2 + n % 3], [0, 1, 1, 1][: 2 + n % 3])
               for n in range(6)]
    features = OnlineFeatures(samples, LocalStates(model, AUX, 0, 2), "float32")
    direct = [features.compute(batch) for batch in ([0, 1], [2], [3, 4, 5])]
    features.stream([[0, 1], [2], [3, 4, 5]], depth=1)
    assert features.records([0, 1])[0]["id"] == "r0" and features.ready is not None
    assert [r["id"] for r in features.records([5])] == ["r5"], "a batch out of turn is computed on the spot"
    for batch, want in zip(([2], [3, 4, 5]), direct[1:]):
        got = features.records(batch)
        assert [r["id"] for r in got] == [r["id"] for r in want]
        # computed on the producer thread, one forward at a time with this thread's: equal up to summation order
        assert all(torch.allclose(g["hidden_state"], w["hidden_state"], atol=1e-6) for g, w in zip(got, want))
    features.close()


def test_engine_capture_needs_the_engine(tmp_path: Path) -> None:
    cfg = RunConfig.model_validate({"capture": {"backend": "vllm"}, "benchmark": {"engines": []},
                                    "runtime": {"engines": {"vllm": {"python": str(tmp_path / "none/python")}}}})
    (problem,) = engine_problems(cfg)
    assert problem.startswith("runtime.engines.vllm.python") and "capture.backend" in problem
