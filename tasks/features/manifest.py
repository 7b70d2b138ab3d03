"""The features manifest: what was captured, how, from which target, and what it costs per token.

Written last by the capture stage (without it the features are unfinished) and read by the trainer, which
refuses a manifest whose layer ids, strategy, mode or target revision differ from its run
(tasks/features/shards.check_manifest).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from contract.config import RunConfig
from tasks.features.preparation import SPLITS, CaptureInputs
from tasks.features.shards import AUX_CONVENTION, FP8, SCHEMA_VERSION, SHARD_SCHEMA, STRATEGY
from tasks.features.writer import ShardPlan


def specforge_bytes_per_token(hidden_size: int) -> int:
    """SpecForge's offline features per token: bf16 aux (3H) + bf16 final hidden (H) + int64 id and mask."""
    return (3 * hidden_size + hidden_size) * 2 + 16


def tensor_layout(cfg: RunConfig, hidden_size: int, layers: int, topk: int) -> dict[str, dict[str, Any]]:
    """dtype and per-token shape of each stored tensor (besides offsets int64 [records + 1])."""
    layout = {"input_ids": {"dtype": "int32", "shape": []}, "loss_mask": {"dtype": "uint8", "shape": []}}
    if cfg.capture.mode == "lossless":
        layout["aux_hidden_state"] = {"dtype": cfg.capture.dtype, "shape": [layers * hidden_size]}
        layout["hidden_state"] = {"dtype": cfg.capture.dtype, "shape": [hidden_size]}
    else:
        layout["aux_hidden_state"] = {"dtype": str(FP8).removeprefix("torch."), "shape": [layers * hidden_size]}
        layout["aux_scale"] = {"dtype": "float16", "shape": [layers]}
        layout["teacher_topk_ids"] = {"dtype": "int32", "shape": [topk], "ids": "draft"}
        layout["teacher_topk_logprobs"] = {"dtype": "float16", "shape": [topk]}
        layout["target_top1"] = {"dtype": "int32", "shape": [], "ids": "target"}
    return layout


def build_manifest(cfg: RunConfig, inputs: CaptureInputs, plans: list[ShardPlan], hashes: dict[Path, str],
                   producer: dict[str, Any]) -> dict[str, Any]:
    """What was captured, how, from which target. In online training mode no shard is written: the manifest
    still names the settings, the vocab mapping and each split's records. `producer`: what computed the states
    (backend, engine and version, layer ids sent to an engine, the in-process verification's figures)."""
    import transformers

    info, aux_ids, mapping, outcomes = inputs.info, inputs.aux_ids, inputs.mapping, inputs.outcomes

    hidden = info.hidden_size
    specforge = specforge_bytes_per_token(hidden)
    topk = min(cfg.capture.compact_topk, mapping.draft_vocab_size)
    layout = tensor_layout(cfg, hidden, len(aux_ids), topk)
    splits: dict[str, Any] = {}
    for split in SPLITS:
        shards = [plan for plan in plans if plan.split == split]
        entries = [{"file": plan.file, "records": len(plan.samples), "tokens": plan.tokens,
                    "bytes": plan.path.stat().st_size, "sha256": hashes[plan.path]} for plan in shards]
        tokens = sum(entry["tokens"] for entry in entries)
        size = sum(entry["bytes"] for entry in entries)
        statuses = [outcome.status for outcome in outcomes if outcome.key.startswith(f"{split}.jsonl:")]
        per_token = size / tokens if tokens else 0.0
        splits[split] = {
            "input": len(statuses), "records": statuses.count("ok"), "skipped": statuses.count("skipped"),
            "error": statuses.count("error"), "tokens": tokens,
            "supervised_tokens": sum(sum(sample.loss_mask) for plan in shards for sample in plan.samples),
            "shards": entries, "bytes": size, "bytes_per_token": per_token,
            "ratio_to_specforge": per_token / specforge,
        }
    all_tokens = sum(info_["tokens"] for info_ in splits.values())
    all_bytes = sum(info_["bytes"] for info_ in splits.values())
    return {
        "schema_version": SCHEMA_VERSION,
        "shard_schema": SHARD_SCHEMA,
        "strategy": STRATEGY,
        "mode": cfg.capture.mode,
        "alignment": "unshifted: row t = token x_t, its loss mask, target states after x_0..x_t",
        "aux_layer_ids": aux_ids,
        "aux_layer_convention": AUX_CONVENTION,
        "hf_hidden_states_indices": [i + 1 for i in aux_ids],
        "dtype": layout["aux_hidden_state"]["dtype"],
        "tensors": layout,
        "compact_topk": topk if cfg.capture.mode == "compact" else None,
        "hidden_size": hidden,
        "num_hidden_layers": info.num_hidden_layers,
        "vocab_size": info.vocab_size,
        "draft_vocab_size": mapping.draft_vocab_size,
        "vocab_mapping": {"path": str(Path("vocab") / inputs.vocab_path.name), "sha256": inputs.vocab_hash,
                          **inputs.vocab_summary},
        "vocab_mapping_sha256": inputs.vocab_hash,
        "online": cfg.training.mode == "online",
        "target_id": info.id,
        "target_revision": info.revision,
        "chat_template_hash": info.chat_template_hash,
        "tokenizer_hash": info.tokenizer_hash,
        "model_dtype": cfg.model.dtype,
        "producer": producer,
        "max_length": cfg.validation.max_length,
        "records_per_shard": cfg.capture.records_per_shard,
        "fingerprint": inputs.fingerprint,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "splits": splits,
        "bytes": all_bytes,
        "bytes_per_token": all_bytes / all_tokens if all_tokens else 0.0,
        "specforge_bytes_per_token": specforge,
        "specforge_note": "SpecForge stores (3H + H) * 2 + 16 bytes/token (bf16 aux + bf16 hidden + int64 ids "
                          "and mask), one pickle file per sample",
        "ratio_to_specforge": (all_bytes / all_tokens if all_tokens else 0.0) / specforge,
    }
