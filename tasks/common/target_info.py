"""What every stage after `target` reads of the materialised target: target.json, its tokenizer and model.

The target stage writes `<output_dir>/target/` and `target.json`; the checkpoint doctor describes any HF
directory the same way, so the revision and tokenizer hashes it checks are the ones the target stage pinned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from contract.chat_rendering import bind_template_kwargs
from contract.config import ModelConfig, RunConfig
from contract.hashing import hash_files, hash_text
from tasks.common.artifacts import read_json
from tasks.common.devices import resolve_device, serving_dtype

# Bump when the conversion of a source changes, so cached conversions are rebuilt.
CONVERTER_VERSION = "1"
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


class TargetInfo(BaseModel):
    """The content of target.json: what later stages and the checkpoint contract pin."""

    id: str
    source: str
    revision: str
    converter_version: str
    architecture: str
    model_type: str  # the family row (models/target_families.py)
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    eos_token: str | None
    tokenizer_hash: str
    chat_template_hash: str | None
    files: list[str]


def target_id(model: ModelConfig) -> str:
    """The name the contract records: the hub id, or the directory for a local target."""
    return str(model.path) if model.source == "local" else model.id


def source_files_of(root: Path) -> list[Path]:
    """The files of an HF directory that define the model: weights, config and tokenizer."""
    files = [root / name for name in HF_SIDE_FILES if (root / name).is_file()]
    weights = [path for path in root.iterdir() if path.suffix == ".safetensors"]
    if not weights:
        raise FileNotFoundError(
            f"{root}: no *.safetensors weights; eaglet loads safetensors only (convert pickled .bin "
            "weights with transformers' save_pretrained on a trusted machine first)"
        )
    return sorted(set(files + weights))


def describe_target(directory: Path, model: ModelConfig, revision: str) -> TargetInfo:
    """Read dims and special tokens from the materialised directory."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(directory, trust_remote_code=model.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=model.trust_remote_code)
    text_config: Any = config.get_text_config() if hasattr(config, "get_text_config") else config
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    tokenizer_files = [directory / name for name in ("tokenizer.json", "tokenizer_config.json") if (directory / name).is_file()]
    return TargetInfo(
        id=target_id(model),
        source=model.source,
        revision=revision,
        converter_version=CONVERTER_VERSION,
        architecture=(config.architectures or ["unknown"])[0],
        model_type=text_config.model_type,
        num_hidden_layers=text_config.num_hidden_layers,
        hidden_size=text_config.hidden_size,
        vocab_size=text_config.vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token=tokenizer.eos_token,
        tokenizer_hash=hash_files(tokenizer_files, root=directory),
        chat_template_hash=hash_text(template) if template else None,
        files=sorted(path.name for path in directory.iterdir() if path.is_file()),
    )


def read_target_info(out: Path) -> TargetInfo:
    """`<out>/target.json`, or a clear error when the target stage has not run."""
    path = out / "target.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no materialised target; run the target stage first")
    try:
        return TargetInfo.model_validate(read_json(path))
    except ValidationError as error:
        fields = "; ".join(f"{'.'.join(map(str, item['loc']))}: {item['msg']}" for item in error.errors())
        raise ValueError(f"{path}: not a target.json this eaglet reads ({fields}); rerun the target stage") from None


def load_tokenizer(directory: Path, model: ModelConfig) -> Any:
    """The target's tokenizer as a run renders with it: `model.chat_template_kwargs` bound to its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=model.trust_remote_code)
    return bind_template_kwargs(tokenizer, model.chat_template_kwargs)


def pad_token_id(tokenizer: Any) -> int:
    """The id batches are padded with (0 when the tokenizer names none; padded positions are masked)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def load_target_model(cfg: RunConfig, directory: Path, dtype: Optional[str] = None) -> Any:
    """The materialised target in `dtype` (default `model.dtype`) on `runtime.device`, with `runtime.threads`
    applied."""
    import torch

    from models.target_loading import load_target

    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    model, _ = load_target(directory, dtype or cfg.model.dtype, cfg.model.trust_remote_code)
    return model.to(resolve_device(cfg.runtime.device))


def features_dtype(cfg: RunConfig) -> str:
    """The dtype the target computes captured states in (`capture.compute_dtype`, resolved on this host)."""
    setting = cfg.capture.compute_dtype
    if setting is None:
        return cfg.model.dtype
    return serving_dtype(setting, cfg.model.dtype, resolve_device(cfg.runtime.device))
