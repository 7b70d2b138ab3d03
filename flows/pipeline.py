"""The Prefect flow `eaglet-pipeline`: the stages in order, each a Prefect task, tracked in MLflow.

Each stage's result (its summary and report paths as plain JSON, flows/stage_records.py) is persisted under
`<output_dir>/.prefect-results` and cached on the stage's inputs (flows/stage_cache.py), so a rerun skips
every stage whose inputs and outputs are unchanged (its task run ends in state "Cached") and DVC would agree
it is up to date. Only failures a retry can cure are retried: an engine alive but not ready within its start-up
timeout, an HTTP server that failed or did not answer (an engine that exited at start-up, whose port is taken or
whose python is missing is not: tasks/serving/engine.py). A failure stops the flow with an
error naming the stage; what the stages before it wrote stays on disk. The flow holds
`<output_dir>/.eaglet.lock` while it runs (tasks/common/run_lock.py), so a scheduled run that overlaps another
run on the same output_dir fails at once naming the holder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import httpx
from prefect import flow, task
from prefect.cache_policies import CachePolicy
from prefect.client.schemas.objects import TaskRun
from prefect.context import TaskRunContext
from prefect.states import State

from contract.config import RunConfig
from contract.config_loading import load_config
from flows.stage_cache import outputs_unchanged, record_outputs, results_dir, stage_cache_key
from flows.placement import STAGE_FLOW, Placement, is_placed, run_placed_stage
from flows.stage_records import JSON_SERIALIZER, StageFailed, StageRecord, recorded, set_aside_unsafe_record
from flows.stages import select_stages, stage_function
from flows.tracking import joined_run, tracked_run
from tasks.common.run_lock import output_dir_lock
from tasks.serving.engine import EngineStartError
from tasks.data.generation_openai import RETRYABLE_STATUS

#: Attempts after the first, and the pause before each: time for a port or GPU memory to be released.
STAGE_RETRIES = 2
RETRY_DELAYS_S = [5, 30]


@dataclass
class StageInputs(CachePolicy):
    """Prefect cache key of a stage (flows/stage_cache.py), computed once by run_stage: hashing the deps walks
    every feature shard, and the key is also where run_stage checks the stored record first."""

    key: str = ""

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> Optional[str]:
        return self.key


def is_transient(error: object) -> bool:
    """An engine start a retry can cure (alive but not ready in time), or an HTTP failure other than a 4xx saying
    the request itself is wrong. An engine that exited at start-up, whose port is taken or whose python, model or
    draft is missing fails the same way however often it is started (EngineStartError.retry_can_cure)."""
    if isinstance(error, EngineStartError):
        return error.retry_can_cure
    if isinstance(error, httpx.HTTPStatusError):
        status = error.response.status_code
        return status >= 500 or status in RETRYABLE_STATUS
    return isinstance(error, httpx.TransportError)


def retry_transient_only(task: Any, task_run: TaskRun, state: State) -> bool:
    """Retry an engine start or HTTP failure; a deterministic one (e.g. a broken data contract) fails at once."""
    return is_transient(state.result(raise_on_failure=False))


def stage_task(name: str, cfg: RunConfig, key: str, use_cache: bool = True) -> Any:
    """The Prefect task of one stage: cached on its inputs unless its outputs changed or caching is off."""
    reuse = use_cache and outputs_unchanged(name, cfg)
    return task(
        recorded(stage_function(name)),
        name=name,
        cache_policy=StageInputs(key=key),
        refresh_cache=not reuse,
        persist_result=True,
        result_storage=results_dir(cfg),
        result_serializer=JSON_SERIALIZER,
        retries=STAGE_RETRIES,
        retry_delay_seconds=RETRY_DELAYS_S,
        retry_condition_fn=retry_transient_only,
    )


def run_stage(name: str, cfg: RunConfig, use_cache: bool = True) -> StageRecord:
    """Run (or reuse) one stage; raise StageFailed naming it when it fails."""
    key = stage_cache_key(name, cfg)
    set_aside_unsafe_record(results_dir(cfg) / key)
    state = stage_task(name, cfg, key, use_cache)(cfg, return_state=True)
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        if not isinstance(error, BaseException):
            error = RuntimeError(state.message or state.name)
        raise StageFailed(name, error) from error
    record_outputs(name, cfg)
    return StageRecord.from_json(state.result())


@flow(name="eaglet-pipeline", log_prints=True)
def pipeline(config_path: str | None = None, overrides: list[str] | None = None, stages: list[str] | None = None,
             use_cache: bool = True, place_stages: bool = False) -> dict[str, dict[str, float]]:
    """Run the selected stages (all by default) of the run config; returns each stage's summary.

    `use_cache=False` runs every selected stage even when its inputs are unchanged (results are still stored,
    so the next cached run can reuse them). `place_stages=True` (runs of a deployment with `deployment.work_pools`)
    runs each stage named there on its work pool (flows/placement.py).
    """
    cfg = load_config(config_path, overrides or [])
    placement = Placement(config_path, list(overrides or []), use_cache) if place_stages else None
    return run_stages(cfg, select_stages(stages), use_cache, placement)


def run_stages(cfg: RunConfig, names: list[str], use_cache: bool = True,
               placement: Optional[Placement] = None) -> dict[str, dict[str, float]]:
    """Run `names` in order under the output_dir lock (taken before MLflow, so a refused run records nothing)."""
    summaries: dict[str, dict[str, float]] = {}
    with output_dir_lock(cfg.output_path, f"eaglet-pipeline flow ({', '.join(names)})"):
        with tracked_run(cfg, run_name=cfg.run_id, tags={"eaglet.kind": "pipeline"}) as tracker:
            for name in names:
                if is_placed(name, cfg, placement):
                    result = run_stage_on_its_pool(name, cfg, placement.parameters(name, tracker.run_id))
                else:
                    result = run_stage(name, cfg, use_cache)
                tracker.log_stage(name, result)
                summaries[name] = result.summary()
    return summaries


def run_stage_on_its_pool(name: str, cfg: RunConfig, parameters: dict[str, Any]) -> StageRecord:
    """A placed stage: its record is read from where the worker's run persists it (the same cache key)."""
    return run_placed_stage(name, cfg, parameters, results_dir(cfg) / stage_cache_key(name, cfg))


@flow(name=STAGE_FLOW, log_prints=True)
def placed_stage(config_path: str | None, overrides: list[str], stage: str, use_cache: bool = True,
                 parent_run_id: str | None = None) -> dict[str, float]:
    """One stage of a pipeline run, on a worker of the pool `deployment.work_pools` gives it: the same cached task
    as in the pipeline's process, logging into the pipeline's MLflow run. Its record goes to output_dir."""
    cfg = load_config(config_path, overrides or [])
    with joined_run(cfg, parent_run_id):
        return run_stage(stage, cfg, use_cache).summary()
