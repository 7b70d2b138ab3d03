"""Records on their way to features: tokenised and masked, with the draft vocabulary built from the train split.

Each record of `data/{train,eval}.jsonl` is rendered and masked by contract/chat_rendering (`render_record`,
with `validation.cut_turns` for turns the target did not finish) and truncated to `validation.max_length`, exactly as validate and
`eaglet inspect` do. Records without a supervised token become skipped outcomes with a reason. The capture
stage writes shards from these samples; online training (tasks/features/online.py) captures from them per batch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from contract.chat_rendering import (CutTurns, RenderedConversation, TemplateError, render_samples, tokenize_with_mask,
                                     unfinished_turns)
from contract.config import RunConfig
from contract.records import Outcome, read_prompt_records
from models.target_capture import resolve_aux_layer_ids
from models.vocab_mapping import VocabMapping, build_vocab_mapping, count_tokens, mapping_summary, save_vocab_mapping
from tasks.common.target_info import TargetInfo, features_dtype, load_tokenizer, read_target_info
from tasks.features.eval_selection import not_kept_reason, record_key, spread_over_sources
from tasks.features.shards import SHARD_SCHEMA

SPLITS = ("train", "eval")


@dataclass
class Sample:
    """One record, tokenised and masked, on its way into a shard."""

    key: str
    id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class CaptureInputs:
    """The records of both splits, tokenised and masked, with the vocab mapping built from the train split:
    what offline capture writes shards from and what online training captures from per batch."""

    info: TargetInfo
    tokenizer: Any
    aux_ids: list[int]
    samples: dict[str, list[Sample]]
    outcomes: list[Outcome]
    source_of: dict[str, str]
    mapping: VocabMapping
    vocab_path: Path
    vocab_hash: str
    vocab_summary: dict[str, Any]
    fingerprint: str


def prepare_inputs(cfg: RunConfig) -> CaptureInputs:
    """Tokenise `<output_dir>/data/{train,eval}.jsonl` and write `vocab/vocab_mapping.safetensors`."""
    out = cfg.output_path
    info = read_target_info(out)
    tokenizer = load_tokenizer(out / "target", cfg.model)
    aux_ids = resolve_aux_layer_ids(cfg.capture.aux_layer_ids, info.num_hidden_layers)
    samples: dict[str, list[Sample]] = {}
    outcomes: list[Outcome] = []
    source_of: dict[str, str] = {}
    for split in SPLITS:
        samples[split] = prepare_split(out / "data" / f"{split}.jsonl", split, tokenizer, cfg.validation.max_length,
                                       info.vocab_size, outcomes, source_of, cfg.validation.cut_turns)
    samples["eval"] = capped_eval_samples(samples["eval"], cfg.capture.eval_records, source_of, outcomes)
    counts = count_tokens(((s.input_ids, s.loss_mask) for s in samples["train"]), info.vocab_size)
    mapping = build_vocab_mapping(counts, info.vocab_size, cfg.capture.draft_vocab_size)
    vocab_path = out / "vocab" / "vocab_mapping.safetensors"
    vocab_summary = mapping_summary(mapping, counts)
    vocab_hash = save_vocab_mapping(mapping, vocab_path, vocab_summary)
    fingerprint = settings_fingerprint(cfg, info, aux_ids, vocab_hash)
    return CaptureInputs(info, tokenizer, aux_ids, samples, outcomes, source_of, mapping, vocab_path, vocab_hash,
                         vocab_summary, fingerprint)


def prepare_split(path: Path, split: str, tokenizer: Any, max_length: int, vocab_size: int,
                  outcomes: list[Outcome], source_of: dict[str, str], cut_turns: CutTurns = "no_end") -> list[Sample]:
    """Tokenise and mask every record of one split; non-ok records become outcomes with a reason.
    validate wrote the file, so a line that is not a PromptRecord is a hard error. A record expanded per turn
    (contract/chat_rendering.py `render_samples`) gives one sample and one outcome per supervised turn,
    each keyed and named with its `#turn<i>` suffix."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {split} records; run the validate stage first")
    samples = []
    for number, record in read_prompt_records(path):
        key = f"{split}.jsonl:{number}"
        source_of[key] = record.source
        if cut_turns == "drop" and unfinished_turns(record):
            outcomes.append(Outcome(key=key, id=record.id, status="skipped",
                                    reason="an assistant turn was cut at regeneration.max_new_tokens "
                                    "(validation.cut_turns: drop)"))
            continue
        try:
            turns = render_samples(tokenizer, record, cut_turns)
        except TemplateError as error:
            outcomes.append(Outcome(key=key, id=record.id, status="error", reason=f"template: {error}"))
            continue
        for turn in turns:
            source_of[key + turn.suffix] = record.source
            sample = prepared_sample(key + turn.suffix, record.id + turn.suffix, turn.rendered, tokenizer, max_length,
                                     vocab_size, outcomes)
            if sample is not None:
                samples.append(sample)
    return samples


def capped_eval_samples(samples: list[Sample], cap: Optional[int], source_of: dict[str, str],
                        outcomes: list[Outcome]) -> list[Sample]:
    """At most `cap` eval records (all their turns), spread over the sources (tasks/features/eval_selection.py);
    the outcomes of the samples left out turn from ok to skipped, so every id stays counted."""
    record_keys = list(dict.fromkeys(record_key(sample.key) for sample in samples))
    kept = set(spread_over_sources(record_keys, source_of, cap))
    left_out = {sample.key for sample in samples if record_key(sample.key) not in kept}
    if not left_out:
        return samples
    for index, outcome in enumerate(outcomes):
        if outcome.key in left_out:
            outcomes[index] = Outcome(key=outcome.key, id=outcome.id, status="skipped", reason=not_kept_reason(cap))
    return [sample for sample in samples if sample.key not in left_out]


def prepared_sample(key: str, sample_id: str, rendered: RenderedConversation, tokenizer: Any, max_length: int,
                    vocab_size: int, outcomes: list[Outcome]) -> Optional[Sample]:
    """The rendered sample's ids and mask, or None with the outcome saying why not."""
    sample = tokenize_with_mask(tokenizer, rendered, max_length)
    if sample.input_ids and max(sample.input_ids) >= vocab_size:
        outcomes.append(Outcome(key=key, id=sample_id, status="error",
                                reason=f"token id {max(sample.input_ids)} outside the target vocab {vocab_size}"))
        return None
    if not sample.supervised_tokens:
        where = (f"in its first {max_length} tokens (validation.max_length)" if sample.truncated
                 else "(no supervised assistant turn)")
        outcomes.append(Outcome(key=key, id=sample_id, status="skipped", reason=f"no supervised token {where}"))
        return None
    outcomes.append(Outcome(key=key, id=sample_id, status="ok"))
    return Sample(key, sample_id, sample.input_ids, sample.loss_mask)


def settings_fingerprint(cfg: RunConfig, info: TargetInfo, aux_ids: list[int], vocab_hash: str) -> str:
    """Everything besides the records that decides a shard's bytes; a shard written under others is redone."""
    settings: dict[str, Any] = {
        "schema": SHARD_SCHEMA, "mode": cfg.capture.mode, "aux_layer_ids": aux_ids,
        "target_revision": info.revision, "tokenizer_hash": info.tokenizer_hash,
        "chat_template_hash": info.chat_template_hash, "model_dtype": cfg.model.dtype, "backend": cfg.capture.backend,
    }
    if features_dtype(cfg) != cfg.model.dtype:  # states computed in another dtype than the model's are other bytes
        settings["compute_dtype"] = features_dtype(cfg)
    if cfg.capture.mode == "lossless":
        settings["dtype"] = cfg.capture.dtype
    else:  # the teacher depends on which ids are in the draft vocab
        settings.update({"compact_topk": cfg.capture.compact_topk, "vocab_mapping_sha256": vocab_hash})
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
