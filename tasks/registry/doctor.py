"""`eaglet doctor`: the contract checks (docs/architecture.md §3, §5) of any checkpoint directory against a target.

Reads only headers (config.json, contract.json, the safetensors header): no tensor is loaded, no torch model
is built, so it runs on any checkpoint in seconds. The register stage runs the same checks before it
registers anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from contract.checkpoint import ENGINES, EXPORT_FILES, CheckpointContract
from contract.hashing import hash_files
from tasks.common.artifacts import read_json
from tasks.registry.gates import Check, checkpoint_checks


def tensor_headers(weights: Path) -> dict[str, tuple[str, list[int]]]:
    """Name -> (safetensors dtype, shape) from the file header, without loading any tensor."""
    from safetensors import safe_open

    headers = {}
    with safe_open(str(weights), framework="pt") as handle:
        for name in handle.keys():
            tensor = handle.get_slice(name)
            headers[name] = (tensor.get_dtype(), list(tensor.get_shape()))
    return headers


def inspect_checkpoint(directory: Path, target_info: dict[str, Any]) -> list[Check]:
    """The checks of one export directory against a target's target.json."""
    missing = [name for name in EXPORT_FILES if not (directory / name).is_file()]
    if missing:
        return [Check("files", False, f"{directory} lacks {', '.join(missing)}")]
    try:
        contract = CheckpointContract.model_validate_json((directory / "contract.json").read_text())
    except ValueError as error:
        return [Check("contract.json", False, f"not a checkpoint contract: {error}")]
    config = read_json(directory / "config.json")
    return checkpoint_checks(config, contract, tensor_headers(directory / "model.safetensors"), target_info)


def export_dirs(directory: Path) -> list[Path]:
    """One export, or each engine export under a `draft/` folder."""
    if (directory / "config.json").is_file():
        return [directory]
    found = [directory / engine for engine in ENGINES if (directory / engine / "config.json").is_file()]
    return found or [directory]


def resolve_target_info(target: Path) -> dict[str, Any]:
    """target.json of a run (the file, the run's output dir, or its `target/` dir), else what the target
    stage would record for a local HF directory (same revision and tokenizer hashes)."""
    if target.is_file():
        return read_json(target)
    if (target / "target.json").is_file():
        return read_json(target / "target.json")
    if target.name == "target" and (target.parent / "target.json").is_file():
        return read_json(target.parent / "target.json")
    if (target / "config.json").is_file():
        return describe_hf_directory(target)
    raise FileNotFoundError(f"{target}: neither a target.json, a run's output dir nor an HF model directory")


def describe_hf_directory(directory: Path) -> dict[str, Any]:
    from contract.config import ModelConfig
    from tasks.common.target_info import describe_target, source_files_of

    revision = hash_files(source_files_of(directory), root=directory)
    model = ModelConfig(source="local", path=str(directory))
    return describe_target(directory, model, revision).model_dump(mode="json")


def doctor(directory: Path, target: Path) -> dict[Path, list[Check]]:
    """Every check of each export under `directory` against the target `target`."""
    target_info = resolve_target_info(target)
    return {export: inspect_checkpoint(export, target_info) for export in export_dirs(directory)}
