"""Stages placed on Prefect work pools: a deployment's GPU stages run on GPU workers, the others elsewhere.

`deployment.work_pools` maps a stage to a work pool. `eaglet deploy` registers, beside the pipeline, one deployment
of the `eaglet-stage` flow per pool named there (`eaglet-stage/<deployment.name>-<pool>`) and gives the pipeline's
runs `place_stages: true`. In such a run a placed stage does not run in the flow's process: the flow starts the
stage's deployment as a subflow run and waits; a worker of that pool runs the stage as the same cached Prefect task
(flows/pipeline.py `placed_stage`), which writes its artifacts and its JSON record under `output_dir`; the flow then
reads that record from `output_dir`. Nothing passes through process memory, so `output_dir` must be storage that
every pool's workers see (a shared filesystem); a record missing after a completed stage run fails the flow naming
the path and that requirement. `eaglet run` always runs every stage in its own process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from contract.config import RunConfig
from flows.stage_records import StageFailed, StageRecord, read_stage_record

STAGE_FLOW = "eaglet-stage"
#: Seconds between the pipeline flow's looks at a placed stage's run.
POLL_INTERVAL_S = 2


class PlacedStageFailed(RuntimeError):
    """The flow run of a placed stage did not complete; the message carries its state and the pool."""


@dataclass(frozen=True)
class Placement:
    """What a placed stage's flow run needs to rebuild the pipeline's config, exactly as the pipeline loaded it."""

    config_path: Optional[str]
    overrides: list[str]
    use_cache: bool

    def parameters(self, stage: str, parent_run_id: Optional[str]) -> dict[str, Any]:
        """The `eaglet-stage` flow's parameters; `parent_run_id` is the pipeline's MLflow run the stage logs into."""
        return {"config_path": self.config_path, "overrides": list(self.overrides), "stage": stage,
                "use_cache": self.use_cache, "parent_run_id": parent_run_id}


def stage_deployment_name(cfg: RunConfig, pool: str) -> str:
    """The name of the `eaglet-stage` deployment that runs this config's stages on `pool`."""
    return f"{cfg.deployment.name}-{pool}"


def stage_pools(cfg: RunConfig) -> list[str]:
    """Every pool `deployment.work_pools` names, once each."""
    return sorted(set(cfg.deployment.work_pools.values()))


def is_placed(name: str, cfg: RunConfig, placement: Optional[Placement]) -> bool:
    return placement is not None and name in cfg.deployment.work_pools


def run_placed_stage(name: str, cfg: RunConfig, parameters: dict[str, Any], record_path: Path) -> StageRecord:
    """Run stage `name` on its work pool, wait for it, and read its record from `record_path` under output_dir."""
    from prefect.deployments import run_deployment

    pool = cfg.deployment.work_pools[name]
    deployment = f"{STAGE_FLOW}/{stage_deployment_name(cfg, pool)}"
    print(f"[placement] stage {name} runs on work pool {pool} ({deployment}); waiting for it", flush=True)
    flow_run = run_deployment(deployment, parameters=parameters, timeout=None, poll_interval=POLL_INTERVAL_S)
    state = flow_run.state
    if state is None or not state.is_completed():
        ended = f"{state.name}: {state.message}" if state is not None else "without a state"
        raise StageFailed(name, PlacedStageFailed(f"its flow run {flow_run.name} on work pool {pool} ended {ended}"))
    if not record_path.is_file():
        missing = FileNotFoundError(f"it ran on work pool {pool}, but its record {record_path} is not there: "
                                    "output_dir must be storage that every pool's workers see")
        raise StageFailed(name, missing)
    return read_stage_record(record_path)
