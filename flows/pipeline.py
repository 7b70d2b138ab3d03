"""The Prefect flow `eaglet-pipeline`: the stages in order, each a Prefect task, tracked in MLflow."""

from __future__ import annotations

from typing import Any

from prefect import flow, task
from prefect.cache_policies import NONE

from contract.config import RunConfig
from contract.config_loading import load_config
from flows.stages import select_stages, stage_function
from flows.tracking import tracked_run


def stage_task(name: str) -> Any:
    """The Prefect task that runs one stage (no result caching yet: stages skip their own up-to-date work)."""
    return task(stage_function(name), name=name, cache_policy=NONE)


@flow(name="eaglet-pipeline", log_prints=True)
def pipeline(config_path: str | None = None, overrides: list[str] | None = None, stages: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Run the selected stages (all by default) of the run config; returns each stage's summary."""
    cfg = load_config(config_path, overrides or [])
    return run_stages(cfg, select_stages(stages))


def run_stages(cfg: RunConfig, names: list[str]) -> dict[str, dict[str, float]]:
    summaries: dict[str, dict[str, float]] = {}
    with tracked_run(cfg, run_name=cfg.run_id, tags={"eaglet.kind": "pipeline"}) as tracker:
        for name in names:
            result = stage_task(name)(cfg)
            tracker.log_stage(name, result)
            summaries[name] = result.summary()
    return summaries
