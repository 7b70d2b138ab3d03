"""Hidden-state capture and the capture stage on the tiny target: real forward passes, real shards."""

from __future__ import annotations

import copy

import json
from pathlib import Path

import pytest
import torch

from contract.chat_rendering import render_record, tokenize_with_mask
from contract.config import RunConfig
from contract.records import GenerationParams, Message, PromptRecord, Provenance, TurnGeneration
from models.target_capture import capture_states, default_aux_layer_ids, resolve_aux_layer_ids
from models.target_loading import load_target
from models.vocab_mapping import build_vocab_mapping, count_tokens, load_vocab_mapping, mapping_hash
from tasks import capture, target
from tasks.common.artifacts import read_json
from tasks.features.shards import FeatureError, FeatureSet, check_manifest, dense_teacher, dequantise_aux

AUX = [1, 2, 3]  # the tiny target has 6 layers: the default [1, 2, 2] repeats a layer
MAX_LENGTH = 96


def record(record_id: str, *turns: tuple[str, str, bool | None], text: str | None = None) -> PromptRecord:
    messages = [Message(role=role, content=content, supervised=supervised) for role, content, supervised in turns]
    return PromptRecord(id=record_id, source=record_id.split(":")[0], messages=messages, text=text,
                        provenance=Provenance(file="hand.jsonl", line=1, format="text" if text else "openai"))


TRAIN = [
    record("chat:greet", ("user", "Hello, how are you today?", None), ("assistant", "I am fine, thank you.", True)),
    record("chat:two", ("system", "Be brief.", None), ("user", "What is the capital of France?", None),
           ("assistant", "Paris.", True), ("user", "And a story?", None),
           ("assistant", "A small bird learns to fly over the sea.", True)),
    record("code:add", ("user", "Write a Python function that adds two numbers.", None),
           ("assistant", "def add(a, b): return a + b", True)),
    record("chat:long", ("user", "Tell me a story about the quick brown fox. " * 12, None),
           ("assistant", "The fox jumps.", True)),  # the answer lies past MAX_LENGTH: skipped
    record("text:pre", text="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello there, the lazy dog<|im_end|>\n"),
    record("chat:unsupervised", ("user", "Hello?", None), ("assistant", "Hi.", False)),  # nothing to learn: skipped
    record("chat:fox", ("user", "Say something.", None), ("assistant", "The quick brown fox jumps over the lazy dog.", True)),
]
EVAL = [
    record("chat:eval", ("user", "What is 0123 plus 456?", None), ("assistant", "It is 579, thank you.", True)),
    record("code:eval", ("user", "A function?", None), ("assistant", "def f(x): return x", True)),
]
SKIPPED = {"chat:long", "chat:unsupervised"}


def write_records(path: Path, records: list[PromptRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r.model_dump(mode="json", exclude_none=True)) + "\n" for r in records))


def make_run(tmp_path: Path, tiny_target_dir: Path, **capture_settings) -> RunConfig:
    cfg = RunConfig.model_validate({
        "output_dir": str(tmp_path / "out"),
        "model": {"source": "local", "path": str(tiny_target_dir)},
        "validation": {"max_length": MAX_LENGTH},
        "capture": {"aux_layer_ids": AUX, "records_per_shard": 2, "draft_vocab_size": 64, "batch_size": 3,
                    **capture_settings},
    })
    target.run(cfg)
    write_records(cfg.output_path / "data" / "train.jsonl", TRAIN)
    write_records(cfg.output_path / "data" / "eval.jsonl", EVAL)
    return cfg


def masked(tokenizer, item: PromptRecord):
    return tokenize_with_mask(tokenizer, render_record(tokenizer, item, "no_end"), MAX_LENGTH)


@pytest.fixture(scope="module")
def tiny_model(tiny_target_dir: Path):
    return load_target(tiny_target_dir)


# --- models/target_capture.py ---------------------------------------------------------------------------------

def test_states_are_hf_hidden_states_of_layer_plus_one(tiny_model) -> None:
    model, _ = tiny_model
    hidden_size, layers = model.config.hidden_size, model.config.num_hidden_layers
    ids = torch.randint(3, model.config.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids, output_hidden_states=True)
    states = reference.hidden_states
    assert len(states) == layers + 1
    all_layers = list(range(layers))
    aux, hidden = capture_states(model, ids, all_layers)
    assert aux.shape == (17, layers * hidden_size) and hidden.shape == (17, hidden_size)
    for position, layer in enumerate(all_layers[:-1]):
        assert torch.equal(aux[:, position * hidden_size:(position + 1) * hidden_size], states[layer + 1][0]), layer
    # HF ties hidden_states[-1] to the NORMED last_hidden_state: it is the lm_head input, not the raw output of
    # the last layer. Our hidden_state is that normed state; our aux for layer N-1 is the raw output.
    last_raw = aux[:, -hidden_size:]
    assert torch.equal(hidden, states[-1][0])
    assert not torch.allclose(last_raw, states[-1][0])
    assert torch.allclose(model.model.norm(last_raw), hidden)
    assert torch.allclose(model.lm_head(hidden), reference.logits[0], atol=1e-5)
    # the ids select and order the concatenation
    aux3, _ = capture_states(model, ids, AUX)
    assert torch.equal(aux3, torch.cat([states[i + 1][0] for i in AUX], dim=-1))


def test_padded_batch_equals_single_records(tiny_model) -> None:
    model, _ = tiny_model
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, 400, (length,), generator=generator).tolist() for length in (9, 23, 1, 16)]
    batched = capture_states(model, sequences, AUX, pad_token_id=2)
    for sequence, (aux, hidden) in zip(sequences, batched):
        single_aux, single_hidden = capture_states(model, torch.tensor([sequence]), AUX)
        assert aux.shape == single_aux.shape == (len(sequence), 3 * model.config.hidden_size)
        assert torch.allclose(aux, single_aux, atol=1e-5) and torch.allclose(hidden, single_hidden, atol=1e-5)


def test_layer_ids_are_checked() -> None:
    assert default_aux_layer_ids(30) == [1, 14, 26] and resolve_aux_layer_ids(None, 30) == [1, 14, 26]
    with pytest.raises(ValueError, match=r"strictly ascending: 2 at position 1 follows 3"):
        resolve_aux_layer_ids([3, 2, 4], 6)
    with pytest.raises(ValueError, match=r"id 6 at position 2 is out of range"):
        resolve_aux_layer_ids([1, 2, 6], 6)
    with pytest.raises(ValueError, match=r"id -1 at position 0"):
        resolve_aux_layer_ids([-1, 2, 3], 6)
    with pytest.raises(ValueError, match=r"default aux layers .* = \[1, 2, 2\].*set capture.aux_layer_ids"):
        resolve_aux_layer_ids(None, 6)


# --- tasks/capture.py -----------------------------------------------------------------------------------------

def test_lossless_capture_end_to_end(tmp_path: Path, tiny_target_dir: Path, tiny_model) -> None:
    cfg = make_run(tmp_path, tiny_target_dir)
    result = capture.run(cfg)
    out = cfg.output_path
    model, tokenizer = tiny_model
    hidden_size, vocab = model.config.hidden_size, model.config.vocab_size
    info = read_json(out / "target.json")

    # accounting
    report = read_json(out / "features" / "capture_report.json")
    assert report["input"] == len(TRAIN) + len(EVAL) == report["ok"] + report["error"] + report["skipped"]
    skipped = {o["id"]: o["reason"] for o in report["outcomes"] if o["status"] == "skipped"}
    assert set(skipped) == SKIPPED
    assert f"first {MAX_LENGTH} tokens" in skipped["chat:long"] and "no supervised assistant turn" in skipped["chat:unsupervised"]

    # manifest
    manifest = read_json(out / "features" / "manifest.json")
    kept = [r for r in TRAIN if r.id not in SKIPPED]
    assert manifest["schema_version"] == 1 and manifest["strategy"] == "eagle3" and manifest["mode"] == "lossless"
    assert manifest["aux_layer_ids"] == AUX and manifest["hf_hidden_states_indices"] == [2, 3, 4]
    assert manifest["aux_layer_convention"] == "output of decoder layer i = HF hidden_states[i+1]"
    assert manifest["dtype"] == "bfloat16" and manifest["hidden_size"] == hidden_size
    assert manifest["vocab_size"] == vocab and manifest["draft_vocab_size"] == 64
    assert manifest["target_revision"] == info["revision"] and manifest["tokenizer_hash"] == info["tokenizer_hash"]
    assert manifest["chat_template_hash"] == info["chat_template_hash"]
    vocab_path = out / "vocab" / "vocab_mapping.safetensors"
    assert manifest["vocab_mapping_sha256"] == mapping_hash(vocab_path) == manifest["vocab_mapping"]["sha256"]
    train = manifest["splits"]["train"]
    assert train["records"] == len(kept) and train["skipped"] == 2 and train["input"] == len(TRAIN)
    assert [s["file"] for s in train["shards"]] == ["train/shard-00000.safetensors", "train/shard-00001.safetensors",
                                                    "train/shard-00002.safetensors"]
    assert sorted(p.name for p in (out / "features" / "train").iterdir()) == [
        "shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    specforge = (3 * hidden_size + hidden_size) * 2 + 16
    assert manifest["specforge_bytes_per_token"] == specforge
    for split in ("train", "eval"):
        info_split = manifest["splits"][split]
        assert info_split["bytes"] == sum((out / "features" / s["file"]).stat().st_size for s in info_split["shards"])
        assert info_split["bytes_per_token"] == pytest.approx(info_split["bytes"] / info_split["tokens"])
        assert info_split["bytes_per_token"] <= specforge, (split, info_split["bytes_per_token"])
        assert info_split["ratio_to_specforge"] == pytest.approx(info_split["bytes_per_token"] / specforge)
    assert result.summary()["train_records"] == len(kept) and result.reports()[0].name == "manifest.json"

    # vocab mapping from the train split's masked tokens
    expected_counts = count_tokens(((s.input_ids, s.loss_mask) for s in map(lambda r: masked(tokenizer, r), kept)), vocab)
    expected = build_vocab_mapping(expected_counts, vocab, 64)
    stored = load_vocab_mapping(vocab_path)
    assert torch.equal(stored.d2t, expected.d2t) and torch.equal(stored.t2d, expected.t2d)
    assert train["supervised_tokens"] == int(expected_counts.sum())

    # records: token rows equal tokenize_with_mask, states equal the target's, token-aligned (unshifted)
    features = FeatureSet(out / "features", "train", verify=True)
    assert len(features) == len(kept) and features.tokens == train["tokens"]
    check_manifest(features.manifest, cfg, info)
    rows = list(features)
    assert [row["id"] for row in rows] == [r.id for r in kept]
    for row, item in zip(rows, kept):
        sample = masked(tokenizer, item)
        assert row["input_ids"].dtype == torch.int32 and row["input_ids"].tolist() == sample.input_ids
        assert row["loss_mask"].dtype == torch.uint8 and row["loss_mask"].tolist() == sample.loss_mask
        assert row["aux_hidden_state"].dtype == torch.bfloat16 and row["hidden_state"].dtype == torch.bfloat16
        with torch.no_grad():
            states = model(torch.tensor([sample.input_ids]), output_hidden_states=True).hidden_states
        want_aux = torch.cat([states[i + 1][0] for i in AUX], dim=-1)
        assert torch.allclose(row["aux_hidden_state"].float(), want_aux, rtol=1e-2, atol=1e-2)
        assert torch.allclose(row["hidden_state"].float(), states[-1][0], rtol=1e-2, atol=1e-2)
    assert features[1]["id"] == kept[1].id and torch.equal(features[-1]["input_ids"], rows[-1]["input_ids"])
    eval_rows = list(FeatureSet(out / "features", "eval"))
    assert [row["id"] for row in eval_rows] == [r.id for r in EVAL]


def test_compact_capture_half_the_bytes_with_a_sparse_teacher(tmp_path: Path, tiny_target_dir: Path, tiny_model) -> None:
    # k = 4: the teacher's k * 6 bytes do not shrink with H, and the tiny target has H = 64 (SmolLM2: k = 16)
    cfg = make_run(tmp_path, tiny_target_dir, mode="compact", compact_topk=4)
    capture.run(cfg)
    model, tokenizer = tiny_model
    hidden_size = model.config.hidden_size
    manifest = read_json(cfg.output_path / "features" / "manifest.json")
    specforge = (3 * hidden_size + hidden_size) * 2 + 16
    assert manifest["mode"] == "compact" and manifest["compact_topk"] == 4 and manifest["dtype"] == "float8_e4m3fn"
    for split in ("train", "eval"):
        assert manifest["splits"][split]["bytes_per_token"] <= 0.5 * specforge, manifest["splits"][split]
    mapping = load_vocab_mapping(cfg.output_path / "vocab" / "vocab_mapping.safetensors")
    used = mapping.used_ids
    features = FeatureSet(cfg.output_path / "features", "train")
    for row in features:
        assert "hidden_state" not in row
        ids = row["input_ids"].long()
        with torch.no_grad():
            output = model(ids[None], output_hidden_states=True)
        states, logits = output.hidden_states, output.logits[0]
        want_aux = torch.cat([states[i + 1][0] for i in AUX], dim=-1)
        assert row["aux_hidden_state"].dtype == torch.float8_e4m3fn and row["aux_scale"].shape == (len(ids), 3)
        aux = features.aux_rows(row)
        error = (aux - want_aux).reshape(len(ids), 3, -1).norm(dim=-1) / want_aux.reshape(len(ids), 3, -1).norm(dim=-1)
        assert float(error.max()) < 0.06, float(error.max())
        assert torch.equal(dequantise_aux(row["aux_hidden_state"], row["aux_scale"]), aux)
        assert torch.equal(row["target_top1"].long(), logits.argmax(-1))
        draft_logprobs = torch.log_softmax(logits[:, used], dim=-1)
        want_values = draft_logprobs.topk(4, dim=-1).values
        assert row["teacher_topk_ids"].dtype == torch.int32 and int(row["teacher_topk_ids"].max()) < 64
        assert torch.allclose(row["teacher_topk_logprobs"].float(), want_values, atol=1e-2)
        stored_at = torch.gather(draft_logprobs, 1, row["teacher_topk_ids"].long())
        assert torch.allclose(stored_at, row["teacher_topk_logprobs"].float(), atol=1e-2), "draft ids, draft-renormalised"
        assert (stored_at[:, 0] >= want_values[:, 0] - 1e-5).all()
        probs = dense_teacher(row["teacher_topk_ids"], row["teacher_topk_logprobs"], 64)
        assert probs.shape == (len(ids), 64) and torch.allclose(probs.sum(-1), torch.ones(len(ids)))


def test_rerun_rewrites_only_the_missing_shard(tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = make_run(tmp_path, tiny_target_dir)
    first = capture.run(cfg)
    assert len(first.shards_written) == 4 and first.shards_kept == []
    shards = cfg.output_path / "features" / "train"
    before = {path.name: path.stat().st_mtime_ns for path in shards.iterdir()}
    (shards / "shard-00002.safetensors").unlink()
    (shards / ".shard-00003.safetensors.abc.tmp").write_bytes(b"left by a killed run")
    second = capture.run(cfg)
    assert second.shards_written == ["train/shard-00002.safetensors"]
    assert sorted(second.shards_kept) == ["eval/shard-00000.safetensors", "train/shard-00000.safetensors",
                                          "train/shard-00001.safetensors"]
    after = {path.name: path.stat().st_mtime_ns for path in shards.iterdir()}
    assert set(after) == set(before)
    assert all(after[name] == before[name] for name in before if name != "shard-00002.safetensors")
    assert second.manifest["splits"] == first.manifest["splits"], "same bytes: the rewrite is deterministic"
    third = capture.run(cfg)
    assert third.shards_written == [] and len(third.shards_kept) == 4
    # changed settings (storage dtype) rewrite everything
    cfg.capture.dtype = "float16"
    assert len(capture.run(cfg).shards_written) == 4


def test_states_computed_in_bfloat16_are_recorded_and_recaptured_when_the_dtype_changes(
        tmp_path: Path, tiny_target_dir: Path, tiny_model) -> None:
    """capture.compute_dtype: the target runs in that dtype, the manifest's producer says so, and shards written in
    another compute dtype are other bytes (redone, never mixed)."""
    from tasks.common.target_info import features_dtype

    cfg = make_run(tmp_path, tiny_target_dir)
    assert features_dtype(cfg) == cfg.model.dtype == "float32", "null: the model's own dtype"
    fp32 = capture.run(cfg)
    cfg.capture.compute_dtype = "bfloat16"
    bf16 = capture.run(cfg)
    assert len(bf16.shards_written) == 4 and bf16.shards_kept == []
    assert fp32.manifest["producer"]["dtype"] == "float32" and bf16.manifest["producer"]["dtype"] == "bfloat16"
    assert bf16.manifest["fingerprint"] != fp32.manifest["fingerprint"]

    model, tokenizer = tiny_model
    first = next(iter(FeatureSet(cfg.output_path / "features", "train")))
    with torch.no_grad():
        ids = first["input_ids"].long().unsqueeze(0)
        in_bf16 = copy.deepcopy(model).to(torch.bfloat16)(ids, output_hidden_states=True).hidden_states
        in_fp32 = model(ids, output_hidden_states=True).hidden_states
    want = torch.cat([in_bf16[i + 1][0] for i in AUX], dim=-1)
    assert torch.allclose(first["aux_hidden_state"].float(), want.float(), rtol=2e-2, atol=2e-2)
    exact = torch.cat([in_fp32[i + 1][0] for i in AUX], dim=-1)
    assert not torch.equal(first["aux_hidden_state"], exact.to(torch.bfloat16)), "computed in bf16, not cast from fp32"
    cfg.capture.compute_dtype = None
    assert len(capture.run(cfg).shards_written) == 4


def test_truncated_or_corrupt_shards_are_refused_naming_the_file(tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = make_run(tmp_path, tiny_target_dir)
    capture.run(cfg)
    features_dir = cfg.output_path / "features"
    shard = features_dir / "train" / "shard-00001.safetensors"
    original = shard.read_bytes()

    shard.write_bytes(original[:-100])
    with pytest.raises(FeatureError, match="shard-00001.safetensors"):
        FeatureSet(features_dir, "train")

    header_garbage = b"\xff" * 12 + original[12:]
    shard.write_bytes(header_garbage)
    features = FeatureSet(features_dir, "train")
    with pytest.raises(FeatureError, match="shard-00001.safetensors"):
        list(features)

    flipped = bytearray(original)
    flipped[len(original) // 2] ^= 0xFF
    shard.write_bytes(bytes(flipped))
    with pytest.raises(FeatureError, match="shard-00001.safetensors.*corrupt"):
        FeatureSet(features_dir, "train", verify=True)

    shard.write_bytes(original[:-100])
    rerun = capture.run(cfg)
    assert rerun.shards_written == ["train/shard-00001.safetensors"]
    assert shard.read_bytes() == original


def test_manifest_of_another_run_is_refused_naming_the_field(tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = make_run(tmp_path, tiny_target_dir)
    manifest = capture.run(cfg).manifest
    info = read_json(cfg.output_path / "target.json")
    check_manifest(manifest, cfg, info)

    other_layers = cfg.model_copy(deep=True)
    other_layers.capture.aux_layer_ids = [1, 2, 4]
    with pytest.raises(ValueError, match=r"'aux_layer_ids': expected \[1, 2, 4\], found \[1, 2, 3\]"):
        check_manifest(manifest, other_layers, info)
    with pytest.raises(ValueError, match=r"'target_revision': expected 'other'"):
        check_manifest(manifest, cfg, {**info, "revision": "other"})
    with pytest.raises(ValueError, match=r"'strategy': expected 'eagle3', found 'eagle2'"):
        check_manifest({**manifest, "strategy": "eagle2"}, cfg, info)
    with pytest.raises(ValueError, match=r"'schema_version': expected 1, found 0"):
        check_manifest({**manifest, "schema_version": 0}, cfg, info)
    compact = cfg.model_copy(deep=True)
    compact.capture.mode = "compact"
    with pytest.raises(ValueError, match=r"'mode': expected 'compact', found 'lossless'"):
        check_manifest(manifest, compact, info)


def cut_record(finish_reasons: list[str]) -> PromptRecord:
    """Two answered turns, regenerated with the given finish reasons ('length': stopped at max_new_tokens)."""
    item = record("chat:cut", ("user", "Tell me a story.", None), ("assistant", "A small bird learns to", True),
                  ("user", "And then?", None), ("assistant", "It flies over the sea.", True))
    turns = [TurnGeneration(turn=index, finish_reason=reason, completion_tokens=5)
             for index, reason in zip((1, 3), finish_reasons)]
    generation = GenerationParams(backend="openai", model_id="tiny", model_revision="r", template_hash="t",
                                  temperature=0.0, top_p=1.0, max_new_tokens=5, seed=0, reasoning="off",
                                  stop_tokens=[], turns=turns)
    return item.model_copy(update={"generation": generation})


def supervised_text(tokenizer, item: PromptRecord, cut_turns: str) -> list[str]:
    sample = tokenize_with_mask(tokenizer, render_record(tokenizer, item, cut_turns), MAX_LENGTH)
    return [tokenizer.decode([token]) for token, mask in zip(sample.input_ids, sample.loss_mask) if mask]


def test_a_turn_cut_at_max_new_tokens_is_supervised_without_an_end_of_turn(tiny_target_dir: Path) -> None:
    """The target never ended the first turn where regeneration stopped it: no_end supervises its text but not
    the <|im_end|> after it; the finished second turn keeps its end of turn; as_finished supervises both ends."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    item = cut_record(["length", "stop"])
    no_end, as_finished = supervised_text(tokenizer, item, "no_end"), supervised_text(tokenizer, item, "as_finished")
    assert no_end.count("<|im_end|>") == 1 and as_finished.count("<|im_end|>") == 2
    assert [token for token in as_finished if token != "<|im_end|>"] == [token for token in no_end if token != "<|im_end|>"]
    assert "".join(no_end).startswith("A small bird learns to") and no_end[-1] == "<|im_end|>"


def test_capture_drops_or_keeps_records_with_cut_turns_as_configured(tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = make_run(tmp_path, tiny_target_dir)
    write_records(cfg.output_path / "data" / "train.jsonl", [*TRAIN, cut_record(["length", "stop"])])
    kept = capture.run(cfg)
    assert "chat:cut" not in {outcome.id for outcome in kept.report.outcomes if outcome.status != "ok"}
    dropped = capture.run(cfg.model_copy(update={"validation": cfg.validation.model_copy(update={"cut_turns": "drop"})}))
    reasons = {outcome.id: outcome.reason for outcome in dropped.report.outcomes if outcome.status == "skipped"}
    assert "validation.cut_turns: drop" in reasons["chat:cut"]
    assert dropped.manifest["splits"]["train"]["records"] == kept.manifest["splits"]["train"]["records"] - 1


def test_eval_records_cap_spreads_over_sources_and_counts_the_rest(tmp_path: Path, tiny_target_dir: Path) -> None:
    from tasks.features.eval_selection import spread_over_sources

    many = [record(f"chat:e{index}", ("user", f"Question {index}?", None), ("assistant", f"Answer {index}.", True))
            for index in range(4)]
    many += [record(f"code:e{index}", ("user", f"Code {index}?", None), ("assistant", f"x = {index}", True))
             for index in range(2)]
    cfg = make_run(tmp_path, tiny_target_dir, eval_records=3)
    write_records(cfg.output_path / "data" / "eval.jsonl", many)
    result = capture.run(cfg)

    eval_rows = list(FeatureSet(cfg.output_path / "features", "eval"))
    assert [row["id"] for row in eval_rows] == ["chat:e0", "chat:e1", "code:e0"], "round-robin over sources, file order"
    report = result.report
    assert report.input == len(TRAIN) + len(many) == report.ok + report.error + report.skipped
    left_out = {o.id: o.reason for o in report.outcomes if o.status == "skipped" and o.id not in SKIPPED}
    assert set(left_out) == {"chat:e2", "chat:e3", "code:e1"}
    assert all("capture.eval_records keeps 3" in reason for reason in left_out.values())
    assert result.manifest["splits"]["eval"]["records"] == 3

    keys = ["a:1", "a:2", "a:3", "b:4"]
    sources = {"a:1": "a", "a:2": "a", "a:3": "a", "b:4": "b"}
    assert spread_over_sources(keys, sources, 2) == ["a:1", "b:4"]
    assert spread_over_sources(keys, sources, None) == keys == spread_over_sources(keys, sources, 9)
