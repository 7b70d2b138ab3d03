"""The stages that exist, in pipeline order, how to reach each one's `run(cfg)`, and what each one reads.

The same names are used by the CLI (`eaglet stage NAME`), the Prefect flow and dvc.yaml. `STAGE_READS` is the one
place a stage declares the config fields it reads: the Prefect cache key hashes exactly these
(flows/stage_cache.py), dvc.yaml's `params` list exactly these (`eaglet dvc sync` writes them, tests/test_pipeline.py
checks), and tests/test_stage_reads.py runs every stage with a config that records each field read and fails on one
declared neither here nor as a stage's `not_inputs`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol, get_args

from contract.config import RunConfig, StageName
from tasks.data.reply_settings import not_reply_fields, reply_fields

STAGE_ORDER: tuple[str, ...] = get_args(StageName)


@dataclass(frozen=True)
class StageReads:
    """What a stage's result depends on besides its dvc.yaml file deps: config fields (a section name covers
    all of its fields) and, for ingest, the content of the files `data.sources` names."""

    params: tuple[str, ...]
    source_files: bool = False
    not_inputs: tuple[str, ...] = ()  # fields this stage reads that change none of its outputs (besides NOT_INPUTS)


#: Read by stages but not inputs of their results: where artifacts go (every path dvc.yaml lists hangs off
#: output_dir), where metrics are logged, and how many CPU threads compute the same numbers.
NOT_INPUTS: tuple[str, ...] = ("output_dir", "tracking", "runtime.threads")

STAGE_READS: dict[str, StageReads] = {
    "target": StageReads(("run_id", "model", "runtime.cache_dir")),
    "ingest": StageReads(("data",), source_files=True),
    # what changes the target's replies, not how requests travel (tasks/data/reply_settings.py; the journal agrees)
    "regenerate": StageReads(reply_fields(), not_inputs=not_reply_fields()),
    "validate": StageReads(("model.chat_template_kwargs", "validation", "regeneration.reasoning", "run_id",
                            "model.trust_remote_code")),
    "capture": StageReads(("model.chat_template_kwargs", "capture", "validation.max_length", "validation.cut_turns",
                           "model.dtype", "model.trust_remote_code", "runtime.device", "training.mode",
                           "runtime.engines")),
    # online training captures itself
    "train": StageReads(("model.chat_template_kwargs", "draft", "training", "deployment.trainer", "capture",
                         "regeneration.reasoning", "model.trust_remote_code", "model.dtype", "runtime.device",
                         "runtime.seed", "runtime.engines", "validation.max_length", "validation.cut_turns")),
    "evaluate": StageReads(("model.chat_template_kwargs", "evaluation", "validation.max_length", "model.dtype",
                            "model.trust_remote_code", "runtime.device", "runtime.seed")),
    "benchmark": StageReads(("model.chat_template_kwargs", "benchmark", "evaluation", "registry.agreement_alpha",
                             "registry.agreement_min_drafts", "registry.agreement_exact", "registry.speedup_concurrency", "runtime.engines",
                             "validation.max_length", "model.trust_remote_code",
                             "model.dtype", "runtime.device")),  # the engines' auto dtype and eager (engine_settings)
    "register": StageReads(("registry", "tracking", "evaluation", "validation.max_length", "run_id")),
}


class StageResult(Protocol):
    def summary(self) -> dict[str, float]: ...

    def reports(self) -> list[Any]: ...


def stage_function(name: str) -> Callable[[RunConfig], StageResult]:
    """`tasks.<name>.run`, imported on demand (stages pull heavy libraries)."""
    if name not in STAGE_ORDER:
        raise KeyError(f"unknown stage '{name}'; stages: {', '.join(STAGE_ORDER)}")
    return importlib.import_module(f"tasks.{name}").run


def stage_reads(name: str) -> StageReads:
    """The declared reads of stage `name` (every stage has an entry: a missing one is a wiring error)."""
    if name not in STAGE_READS:
        raise KeyError(f"stage '{name}' declares no reads; add it to STAGE_READS in {__name__}")
    return STAGE_READS[name]


def select_stages(names: list[str] | None) -> list[str]:
    """The requested stages in pipeline order (all when None)."""
    if not names:
        return list(STAGE_ORDER)
    unknown = [name for name in names if name not in STAGE_ORDER]
    if unknown:
        raise KeyError(f"unknown stage(s) {', '.join(unknown)}; stages: {', '.join(STAGE_ORDER)}")
    return [name for name in STAGE_ORDER if name in names]
