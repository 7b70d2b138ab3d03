"""target stage: materialise the target model as an HF directory with an immutable revision.

Writes `<output_dir>/target/` (config, safetensors, tokenizer, chat template) and `<output_dir>/target.json`
(id, source, revision = content hash of the source files, dims, tokenizer and template hashes).
A rerun whose source files hash the same is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from contract.config import ModelConfig, RunConfig
from contract.hashing import hash_files
from tasks.common.artifacts import atomic_directory, link_or_copy, read_json, write_json
from tasks.common.assets import asset_path
from tasks.common.target_info import CONVERTER_VERSION, TargetInfo, describe_target, source_files_of, target_id


@dataclass
class TargetResult:
    directory: Path
    info: TargetInfo
    skipped: bool

    def summary(self) -> dict[str, float]:
        """Numbers worth tracking (MLflow metrics)."""
        return {"num_hidden_layers": self.info.num_hidden_layers, "hidden_size": self.info.hidden_size,
                "vocab_size": self.info.vocab_size, "skipped": float(self.skipped)}

    def reports(self) -> list[Path]:
        """Small files worth attaching to the tracking run (never the weights)."""
        return [self.directory.parent / "target.json"]


@dataclass
class SourceFiles:
    """The files a target is made from; their content hash is the target's revision."""

    kind: str
    root: Path
    files: list[Path]
    gguf_file: str | None = None


def run(cfg: RunConfig) -> TargetResult:
    """Materialise cfg.model into the run's output dir (skipped when already up to date)."""
    out_dir = cfg.output_path / "target"
    info_path = cfg.output_path / "target.json"
    source = resolve_source(cfg.model)
    revision = hash_files(source.files, root=source.root)
    current = read_up_to_date_info(info_path, out_dir, revision, target_id(cfg.model))
    if current is not None:
        return TargetResult(out_dir, current, skipped=True)
    if source.kind == "embedded":
        converted = convert_gguf_cached(source, revision, cache_root(cfg))
        source = SourceFiles("converted", converted, sorted(p for p in converted.iterdir() if p.is_file()))
    with atomic_directory(out_dir) as staging:
        copy_hf_directory(source, staging, cfg.model.trust_remote_code)
        info = describe_target(staging, cfg.model, revision)
    write_json(info_path, info)
    return TargetResult(out_dir, info, skipped=False)


def resolve_source(model: ModelConfig) -> SourceFiles:
    """Find the source files of the configured target (never downloads)."""
    if model.source == "embedded":
        gguf = asset_path("smollm2-gguf")
        return SourceFiles("embedded", gguf.parent, [gguf], gguf_file=gguf.name)
    if model.source == "local":
        root = Path(model.path or "").expanduser()
        if not (root / "config.json").is_file():
            raise FileNotFoundError(f"model.path '{root}': not an HF model directory (no config.json)")
        return SourceFiles("local", root, source_files_of(root))
    root = hub_cache_snapshot(model.id, model.revision)
    return SourceFiles("hub", root, source_files_of(root))


def hub_cache_snapshot(repo_id: str, revision: str | None) -> Path:
    """The local HF cache snapshot of a hub id; this machine never downloads."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = os.environ.get("HF_HUB_CACHE")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model.id '{repo_id}' (revision {revision or 'main'}) is not in the local HF cache "
            f"({cache or 'default HF cache'}); "
            "eaglet does not download: fetch it on a connected machine, or set model.source=local "
            "with model.path pointing to the directory"
        ) from None


def read_up_to_date_info(info_path: Path, out_dir: Path, revision: str, model_id: str) -> TargetInfo | None:
    """target.json when it matches this revision and every file it lists is present, else None."""
    if not info_path.is_file():
        return None
    try:
        info = TargetInfo.model_validate(read_json(info_path))
    except (ValueError, json.JSONDecodeError):
        return None
    fresh = info.revision == revision and info.converter_version == CONVERTER_VERSION and info.id == model_id
    if fresh and all((out_dir / name).is_file() for name in info.files):
        return info
    return None


def cache_root(cfg: RunConfig) -> Path:
    configured = cfg.runtime.cache_dir or os.environ.get("EAGLET_CACHE") or "~/.cache/eaglet"
    return Path(configured).expanduser()


def convert_gguf_cached(source: SourceFiles, revision: str, cache: Path) -> Path:
    """Dequantise the GGUF once per (file hash, converter version) into the cache."""
    from models.target_loading import dequantise_gguf

    cached = cache / "targets" / f"{revision[:16]}-v{CONVERTER_VERSION}"
    if (cached / "config.json").is_file():
        return cached
    print(f"[target] dequantising {source.gguf_file} once into {cached} (about 30 s)", flush=True)
    model, tokenizer = dequantise_gguf(source.root, source.gguf_file or "")
    with atomic_directory(cached) as staging:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
    return cached


def copy_hf_directory(source: SourceFiles, destination: Path, trust_remote_code: bool) -> None:
    """Link the (immutable) safetensors weights, copy the small files, and re-save the tokenizer so its
    chat template sits beside it. Small files are copied, never linked: re-saving writes into them."""
    from transformers import AutoTokenizer

    for path in source.files:
        if path.suffix == ".safetensors":
            link_or_copy(path, destination / path.name)
        else:
            shutil.copy2(path, destination / path.name)

    tokenizer = AutoTokenizer.from_pretrained(source.root, trust_remote_code=trust_remote_code)
    tokenizer.save_pretrained(destination)
