"""capture stage: run the target over the validated records and store the EAGLE3 training features.

Reads `data/train.jsonl`, `data/eval.jsonl` (PromptRecord lines), the target at `target/` and `target.json`.
Each record is rendered, masked and truncated to `validation.max_length` exactly as validate and `eaglet inspect`
do (tasks/features/preparation.py); records without a supervised token are skipped and reported.

Writes
  vocab/vocab_mapping.safetensors     d2t/t2d from the loss-masked train tokens (models/vocab_mapping.py)
  features/{train,eval}/shard-*.safetensors   `capture.records_per_shard` records each
                                      (format: tasks/features/shards.py, writing: tasks/features/writer.py)
  features/manifest.json              what, how, from which target; bytes/token against SpecForge's
  features/capture_report.json        one outcome per input line: ok + error + skipped == input

Each shard is written to a temp name and renamed. A rerun keeps every shard whose records, tokens and
capture settings are unchanged and still readable, and writes only the rest (a killed run resumes at the
first missing shard). The manifest is written last: without it, the features are not finished.

    .venv/bin/eaglet stage capture --config params.yaml
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from contract.chat_rendering import TURN_SUFFIX
from contract.config import RunConfig
from contract.hashing import hash_file
from contract.records import Outcome, StageReport
from tasks.common.artifacts import write_json
from tasks.common.progress import advance, progress_bar
from tasks.common.target_info import features_dtype, load_target_model, pad_token_id
from tasks.features.engine_check import verification_sample, verify_engine_states
from tasks.features.engine_states import (LAYER_CONVENTION, EngineStates, capture_engine, engine_layer_ids,
                                          engine_version)
from tasks.features.manifest import build_manifest
from tasks.features.preparation import SPLITS, CaptureInputs, prepare_inputs
from tasks.features.state_sources import LocalStates, StateSource
from tasks.features.writer import ShardPlan, plan_shards, remove_stale_files, shard_is_current, write_shard


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
        numbers["capture_tokens_per_second"] = self.report.metrics.get("capture_tokens_per_second", 0.0)
        return numbers

    def reports(self) -> list[Path]:
        """Small files worth attaching to the tracking run (never the shards)."""
        return [self.manifest_path, self.report_path]


@contextmanager
def opened_source(cfg: RunConfig, inputs: CaptureInputs,
                  features_dir: Path) -> Iterator[tuple[StateSource, dict[str, Any]]]:
    """The source `capture.backend` names, ready (the target loaded, or the engine started and later stopped),
    with what the manifest records of it as `producer`."""
    if cfg.capture.backend == "local":
        import transformers

        model = load_target_model(cfg, cfg.output_path / "target", features_dtype(cfg))
        yield (LocalStates(model, inputs.aux_ids, pad_token_id(inputs.tokenizer), cfg.capture.batch_size),
               {"backend": "local", "engine": "transformers", "version": transformers.__version__,
                "dtype": features_dtype(cfg)})
        return
    layer_ids = engine_layer_ids(inputs.aux_ids, inputs.info.num_hidden_layers)
    with capture_engine(cfg, layer_ids, features_dir / ".engine-states", "capture-vllm.log") as engine:
        yield (EngineStates.for_run(cfg, engine, layer_ids),
               {"backend": "vllm", "engine": "vllm", "version": engine_version(engine), "dtype": features_dtype(cfg),
                "engine_layer_ids": layer_ids, "layer_id_convention": LAYER_CONVENTION})


def turn_expansion_counts(outcomes: list[Outcome]) -> dict[str, float]:
    """Multi-turn reasoning records expanded into one sample per turn: how many, and the samples they became."""
    expanded = [outcome.key for outcome in outcomes if TURN_SUFFIX in outcome.key]
    records = {key.split(TURN_SUFFIX)[0] for key in expanded}
    return {"records_expanded_per_turn": float(len(records)), "turn_samples": float(len(expanded))}


def verify_written(cfg: RunConfig, source: EngineStates, inputs: CaptureInputs,
                   written: list[ShardPlan]) -> dict[str, Any]:
    """`capture.verify_fraction` of the records just captured by the engine, captured again in-process."""
    samples = verification_sample([sample for plan in written for sample in plan.samples], cfg.capture.verify_fraction)
    if not samples:
        return {"records": [], "skipped": "capture.verify_fraction is 0"}
    model = load_target_model(cfg, cfg.output_path / "target", features_dtype(cfg))
    return verify_engine_states(source, model, samples, inputs.aux_ids, features_dtype(cfg))


def previous_producer(manifest_path: Path, cfg: RunConfig) -> dict[str, Any]:
    """Who wrote the shards a run keeps: the finished manifest's record of it (shards are only kept under the
    same backend, which is part of their fingerprint)."""
    try:
        return dict(json.loads(manifest_path.read_text()).get("producer") or {"backend": cfg.capture.backend})
    except (OSError, ValueError):
        return {"backend": cfg.capture.backend}


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
    if not online:  # online writes no shard: an offline run's shards stay for a switch back
        remove_stale_files(features_dir, plans)

    manifest_path = features_dir / "manifest.json"
    hashes = {plan.path: hash_file(plan.path) for plan in kept}
    producer = previous_producer(manifest_path, cfg)
    seconds = 0.0
    if todo:
        manifest_path.unlink(missing_ok=True)  # the features are unfinished until the manifest is back
        with opened_source(cfg, inputs, features_dir) as (source, producer):
            started = time.perf_counter()
            with progress_bar("capture", sum(len(plan.samples) for plan in todo)) as bar:
                for plan in todo:
                    hashes[plan.path] = write_shard(plan, source, cfg, inputs.mapping, inputs.fingerprint,
                                                    lambda n: advance(bar, n))
            seconds = time.perf_counter() - started
            if isinstance(source, EngineStates):
                producer["verify"] = verify_written(cfg, source, inputs, todo)

    manifest = build_manifest(cfg, inputs, plans, hashes, producer)
    report = StageReport.from_outcomes("capture", inputs.outcomes, inputs.source_of)
    written_tokens = sum(plan.tokens for plan in todo)
    report.metrics.update({
        "tokens": float(sum(manifest["splits"][s]["tokens"] for s in SPLITS)),
        "supervised_tokens": float(sum(manifest["splits"][s]["supervised_tokens"] for s in SPLITS)),
        "shards_written": float(len(todo)), "shards_kept": float(len(kept)),
        "capture_tokens_per_second": written_tokens / seconds if seconds else 0.0,
        **turn_expansion_counts(inputs.outcomes),
    })
    report_path = features_dir / "capture_report.json"
    write_json(report_path, report)
    write_json(manifest_path, manifest)
    return CaptureResult(features_dir, manifest_path, report_path, inputs.vocab_path, manifest, report,
                         [plan.file for plan in todo], [plan.file for plan in kept])
