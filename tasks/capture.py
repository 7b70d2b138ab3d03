"""capture stage: run the target over the validated records and store the EAGLE3 training features.

Reads `data/train.jsonl`, `data/eval.jsonl` (PromptRecord lines), the target at `target/` and `target.json`.
Each record is rendered and masked by contract/chat_rendering (pre-templated `text` through
`spans_in_pretemplated`) and truncated to `validation.max_length`, exactly as validate and `eaglet inspect`
do. Records without a supervised token are skipped and reported.

Writes
  vocab/vocab_mapping.safetensors     d2t/t2d from the loss-masked train tokens (models/vocab_mapping.py)
  features/{train,eval}/shard-*.safetensors   `capture.records_per_shard` records each (format: tasks/features.py)
  features/manifest.json              what, how, from which target; bytes/token against SpecForge's
  features/capture_report.json        one outcome per input line: ok + error + skipped == input

Each shard is written to a temp name and renamed. A rerun keeps every shard whose records, tokens and
capture settings are unchanged and still readable, and writes only the rest (a killed run resumes at the
first missing shard). The manifest is written last: without it, the features are not finished.

    .venv/bin/eaglet stage capture --config params.yaml
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from contract.chat_rendering import TemplateError, render_with_spans, spans_in_pretemplated, tokenize_with_mask
from contract.config import RunConfig
from contract.records import Outcome, StageReport, read_prompt_records
from models.target_capture import capture_states, resolve_aux_layer_ids, teacher_topk
from models.vocab_mapping import (VocabMapping, build_vocab_mapping, count_tokens, mapping_summary,
                                  save_vocab_mapping, write_safetensors)
from tasks.artifacts import atomic_file, read_json, write_json
from tasks.devices import resolve_device
from tasks.features import (AUX_CONVENTION, FP8, SCHEMA_VERSION, SHARD_SCHEMA, STRATEGY, FeatureError, file_sha256,
                            load_shard, quantise_aux)
from tasks.progress import advance, progress_bar
from tasks.target import TargetInfo

SPLITS = ("train", "eval")
SHARD_NAME = "shard-{:05d}.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def specforge_bytes_per_token(hidden_size: int) -> int:
    """SpecForge's offline features per token: bf16 aux (3H) + bf16 final hidden (H) + int64 id and mask."""
    return (3 * hidden_size + hidden_size) * 2 + 16


@dataclass
class Sample:
    """One record, tokenised and masked, on its way into a shard."""

    key: str
    id: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class ShardPlan:
    split: str
    index: int
    samples: list[Sample]
    path: Path

    @property
    def file(self) -> str:
        return f"{self.split}/{self.path.name}"

    @property
    def tokens(self) -> int:
        return sum(len(sample.input_ids) for sample in self.samples)

    def input_hash(self) -> str:
        """Identifies exactly which tokens and masks the shard holds."""
        digest = hashlib.sha256()
        for sample in self.samples:
            digest.update(json.dumps([sample.id, sample.input_ids, sample.loss_mask]).encode())
        return digest.hexdigest()


@dataclass
class CaptureResult:
    features_dir: Path
    manifest_path: Path
    report_path: Path
    vocab_path: Path
    manifest: dict[str, Any]
    report: StageReport
    shards_written: list[str] = field(default_factory=list)
    shards_kept: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        """Numbers worth tracking (MLflow metrics)."""
        numbers: dict[str, float] = {"input": self.report.input, "ok": self.report.ok, "error": self.report.error,
                                     "skipped": self.report.skipped, "shards_written": len(self.shards_written),
                                     "shards_kept": len(self.shards_kept),
                                     "specforge_bytes_per_token": self.manifest["specforge_bytes_per_token"]}
        for split, info in self.manifest["splits"].items():
            for name in ("records", "tokens", "supervised_tokens", "bytes_per_token", "ratio_to_specforge"):
                numbers[f"{split}_{name}"] = info[name]
        numbers["vocab_coverage"] = self.manifest["vocab_mapping"].get("coverage", 1.0)
        return numbers

    def reports(self) -> list[Path]:
        """Small files worth attaching to the tracking run (never the shards)."""
        return [self.manifest_path, self.report_path]


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
    tokenizer = load_tokenizer(out / "target", cfg.model.trust_remote_code)
    aux_ids = resolve_aux_layer_ids(cfg.capture.aux_layer_ids, info.num_hidden_layers)
    samples: dict[str, list[Sample]] = {}
    outcomes: list[Outcome] = []
    source_of: dict[str, str] = {}
    for split in SPLITS:
        samples[split] = prepare_split(out / "data" / f"{split}.jsonl", split, tokenizer, cfg.validation.max_length,
                                       info.vocab_size, outcomes, source_of)
    counts = count_tokens(((s.input_ids, s.loss_mask) for s in samples["train"]), info.vocab_size)
    mapping = build_vocab_mapping(counts, info.vocab_size, cfg.capture.draft_vocab_size)
    vocab_path = out / "vocab" / "vocab_mapping.safetensors"
    vocab_summary = mapping_summary(mapping, counts)
    vocab_hash = save_vocab_mapping(mapping, vocab_path, vocab_summary)
    fingerprint = settings_fingerprint(cfg, info, aux_ids, vocab_hash)
    return CaptureInputs(info, tokenizer, aux_ids, samples, outcomes, source_of, mapping, vocab_path, vocab_hash,
                         vocab_summary, fingerprint)


def run(cfg: RunConfig) -> CaptureResult:
    """Capture features for `<output_dir>/data/{train,eval}.jsonl` into `<output_dir>/features/`."""
    inputs = prepare_inputs(cfg)
    features_dir = cfg.output_path / "features"
    online = cfg.training.mode == "online"  # the trainer runs the target itself: no shards on disk
    plans = [] if online else [plan for split in SPLITS for plan in plan_shards(
        features_dir, split, inputs.samples[split], cfg.capture.records_per_shard)]
    kept, todo = [], []
    for plan in plans:
        (kept if shard_is_current(plan, inputs.fingerprint, cfg.capture.mode) else todo).append(plan)
    remove_stale_files(features_dir, plans)

    manifest_path = features_dir / "manifest.json"
    hashes = {plan.path: file_sha256(plan.path) for plan in kept}
    if todo:
        manifest_path.unlink(missing_ok=True)  # the features are unfinished until the manifest is back
        model = load_model(cfg, cfg.output_path / "target")
        started = time.perf_counter()
        with progress_bar("capture", sum(len(plan.samples) for plan in todo)) as bar:
            for plan in todo:
                hashes[plan.path] = write_shard(plan, model, cfg, inputs.aux_ids, inputs.mapping, inputs.fingerprint,
                                                pad_token_id(inputs.tokenizer), lambda n: advance(bar, n))
        seconds = time.perf_counter() - started
    else:
        seconds = 0.0

    manifest = build_manifest(cfg, inputs, plans, hashes)
    report = StageReport.from_outcomes("capture", inputs.outcomes, inputs.source_of)
    written_tokens = sum(plan.tokens for plan in todo)
    report.metrics.update({
        "tokens": float(sum(manifest["splits"][s]["tokens"] for s in SPLITS)),
        "supervised_tokens": float(sum(manifest["splits"][s]["supervised_tokens"] for s in SPLITS)),
        "shards_written": float(len(todo)), "shards_kept": float(len(kept)),
        "capture_tokens_per_second": written_tokens / seconds if seconds else 0.0,
    })
    report_path = features_dir / "capture_report.json"
    write_json(report_path, report)
    write_json(manifest_path, manifest)
    return CaptureResult(features_dir, manifest_path, report_path, inputs.vocab_path, manifest, report,
                         [plan.file for plan in todo], [plan.file for plan in kept])


# --- inputs -------------------------------------------------------------------------------------------------

def read_target_info(out: Path) -> TargetInfo:
    path = out / "target.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no materialised target; run the target stage first")
    return TargetInfo.model_validate(read_json(path))


def load_tokenizer(directory: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)


def pad_token_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def load_model(cfg: RunConfig, directory: Path) -> Any:
    from models.target_loading import load_target

    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    model, _ = load_target(directory, cfg.model.dtype, cfg.model.trust_remote_code)
    return model.to(resolve_device(cfg.runtime.device))


def prepare_split(path: Path, split: str, tokenizer: Any, max_length: int, vocab_size: int,
                  outcomes: list[Outcome], source_of: dict[str, str]) -> list[Sample]:
    """Tokenise and mask every record of one split; non-ok records become outcomes with a reason.
    validate wrote the file, so a line that is not a PromptRecord is a hard error."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {split} records; run the validate stage first")
    samples = []
    for number, record in read_prompt_records(path):
        key = f"{split}.jsonl:{number}"
        source_of[key] = record.source
        try:
            rendered = (spans_in_pretemplated(tokenizer, record.text) if record.text is not None
                        else render_with_spans(tokenizer, record.messages))
            sample = tokenize_with_mask(tokenizer, rendered, max_length)
        except TemplateError as error:
            outcomes.append(Outcome(key=key, id=record.id, status="error", reason=f"template: {error}"))
            continue
        if sample.input_ids and max(sample.input_ids) >= vocab_size:
            outcomes.append(Outcome(key=key, id=record.id, status="error",
                                    reason=f"token id {max(sample.input_ids)} outside the target vocab {vocab_size}"))
            continue
        if not sample.supervised_tokens:
            where = (f"in its first {max_length} tokens (validation.max_length)" if sample.truncated
                     else "(no supervised assistant turn)")
            outcomes.append(Outcome(key=key, id=record.id, status="skipped", reason=f"no supervised token {where}"))
            continue
        outcomes.append(Outcome(key=key, id=record.id, status="ok"))
        samples.append(Sample(key, record.id, sample.input_ids, sample.loss_mask))
    return samples


def settings_fingerprint(cfg: RunConfig, info: TargetInfo, aux_ids: list[int], vocab_hash: str) -> str:
    """Everything besides the records that decides a shard's bytes; a shard written under others is redone."""
    settings: dict[str, Any] = {
        "schema": SHARD_SCHEMA, "mode": cfg.capture.mode, "aux_layer_ids": aux_ids,
        "target_revision": info.revision, "tokenizer_hash": info.tokenizer_hash,
        "chat_template_hash": info.chat_template_hash, "model_dtype": cfg.model.dtype,
    }
    if cfg.capture.mode == "lossless":
        settings["dtype"] = cfg.capture.dtype
    else:  # the teacher depends on which ids are in the draft vocab
        settings.update({"compact_topk": cfg.capture.compact_topk, "vocab_mapping_sha256": vocab_hash})
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


# --- shards -------------------------------------------------------------------------------------------------

def plan_shards(features_dir: Path, split: str, samples: list[Sample], per_shard: int) -> list[ShardPlan]:
    return [ShardPlan(split, index, samples[start:start + per_shard],
                      features_dir / split / SHARD_NAME.format(index))
            for index, start in enumerate(range(0, len(samples), per_shard))]


def shard_is_current(plan: ShardPlan, fingerprint: str, mode: str) -> bool:
    """True when the shard on disk is readable and holds exactly the planned records under these settings."""
    if not plan.path.is_file():
        return False
    try:
        tensors, record_ids, metadata = load_shard(plan.path, mode)
    except FeatureError as error:
        print(f"[capture] rewriting {plan.path}: {error}", flush=True)
        return False
    return (metadata.get("fingerprint") == fingerprint and metadata.get("input_hash") == plan.input_hash()
            and record_ids == [sample.id for sample in plan.samples] and int(tensors["offsets"][-1]) == plan.tokens)


def remove_stale_files(features_dir: Path, plans: list[ShardPlan]) -> None:
    """Shards beyond the plan (an earlier, larger run) and temp files of a killed run."""
    planned = {plan.path for plan in plans}
    for split in SPLITS:
        directory = features_dir / split
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            stale_shard = path.name.startswith("shard-") and path.suffix == ".safetensors" and path not in planned
            if stale_shard or (path.name.startswith(".shard-") and path.name.endswith(".tmp")):
                path.unlink()


class HashingWriter:
    """A binary handle that hashes what passes through it."""

    def __init__(self, handle: Any) -> None:
        self.handle, self.digest = handle, hashlib.sha256()

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self.handle.write(data)


def write_shard(plan: ShardPlan, model: Any, cfg: RunConfig, aux_ids: list[int], mapping: VocabMapping,
                fingerprint: str, pad_id: int, advance_by: Any) -> str:
    """Run the target over the shard's records (length-sorted batches) and write the shard atomically;
    returns its sha256."""
    settings = cfg.capture
    per_record: list[dict[str, torch.Tensor]] = [{} for _ in plan.samples]
    order = sorted(range(len(plan.samples)), key=lambda i: len(plan.samples[i].input_ids), reverse=True)
    draft_ids = mapping.used_ids
    for start in range(0, len(order), settings.batch_size):
        batch = order[start:start + settings.batch_size]
        states = capture_states(model, [plan.samples[i].input_ids for i in batch], aux_ids, pad_token_id=pad_id)
        for index, (aux, hidden) in zip(batch, states):
            sample = plan.samples[index]
            if settings.mode == "lossless":
                per_record[index] = lossless_tensors(sample, aux, hidden, settings.dtype)
            else:
                tensors = per_record[index]
                tensors.update(token_tensors(sample))
                tensors["aux_hidden_state"], tensors["aux_scale"] = quantise_aux(aux.cpu(), len(aux_ids))
                ids, logprobs, top1 = teacher_topk(model, hidden, draft_ids, settings.compact_topk)
                tensors.update(teacher_topk_ids=ids, teacher_topk_logprobs=logprobs, target_top1=top1)
        advance_by(len(batch))
    lengths = torch.tensor([0] + [len(sample.input_ids) for sample in plan.samples], dtype=torch.int64)
    pieces: dict[str, Any] = {name: [tensors[name] for tensors in per_record] for name in per_record[0]}
    pieces["offsets"] = torch.cumsum(lengths, 0)
    metadata = {"schema": SHARD_SCHEMA, "split": plan.split, "mode": settings.mode, "fingerprint": fingerprint,
                "input_hash": plan.input_hash(), "record_ids": json.dumps([sample.id for sample in plan.samples])}
    with atomic_file(plan.path, "wb") as handle:
        writer = HashingWriter(handle)
        write_safetensors(writer, pieces, metadata)
    return writer.digest.hexdigest()


def token_tensors(sample: Sample) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor(sample.input_ids, dtype=torch.int32),
            "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.uint8)}


def lossless_tensors(sample: Sample, aux: torch.Tensor, hidden: torch.Tensor, dtype: str,
                     device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """One record's lossless features, stored in `capture.dtype` (online training rounds the same way)."""
    return {**token_tensors(sample), "aux_hidden_state": aux.to(device, DTYPES[dtype]),
            "hidden_state": hidden.to(device, DTYPES[dtype])}


# --- manifest -----------------------------------------------------------------------------------------------

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


def build_manifest(cfg: RunConfig, inputs: CaptureInputs, plans: list[ShardPlan], hashes: dict[Path, str]) -> dict[str, Any]:
    """What was captured, how, from which target. In online training mode no shard is written: the manifest
    still names the settings, the vocab mapping and each split's records."""
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
