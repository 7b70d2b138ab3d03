"""Scheduled runs of the `eaglet-pipeline` flow: served by this process, or registered with a work pool.

    eaglet deploy --config params.yaml --cron "0 3 * * 0"                     # serve (blocks; Ctrl-C stops)
    eaglet deploy --config params.yaml --cron "0 3 * * 0" --work-pool gpu     # register; the pool's workers run it

Both need a Prefect API: locally `prefect server start --host 127.0.0.1` and
`PREFECT_API_URL=http://127.0.0.1:4200/api` (with PREFECT_SERVER_ANALYTICS_ENABLED=false).
The deployment is named `deployment.name` of the run config; the cron comes from `--cron` or
`deployment.cron`, the pool from `--work-pool` or `deployment.work_pool`. Its parameters are the absolute
config path, the overrides and the stages, so every scheduled run resolves the same config.

Serve: the `eaglet deploy` process polls the API and runs each scheduled run in a subprocess; it must stay up.

Work pool (a cluster): the flow is registered by module path (`flows.pipeline.pipeline`), so no image or code
upload is needed when eaglet is installed on the worker nodes (`pip install -e .` of the same revision):

    prefect work-pool create gpu --type process                # once
    prefect worker start --pool gpu                            # on each GPU node, in eaglet's venv
    eaglet deploy --config /shared/params.yaml --cron "0 3 * * 0" --work-pool gpu

With `deployment.work_pools` (stage -> pool), `eaglet deploy` also registers `eaglet-stage/<name>-<pool>` for each
pool named there, and the pipeline's runs send those stages to it (flows/placement.py; docs/cluster.md).

The same deployment as a `prefect.yaml` for `prefect deploy --all` (run from the repository root; the
workers find the code in the same checkout, e.g. on a shared filesystem):

    pull:
      - prefect.deployments.steps.set_working_directory: {directory: /shared/eaglet}
    deployments:
      - name: eaglet-scheduled
        entrypoint: flows/pipeline.py:pipeline
        work_pool: {name: gpu}
        schedules: [{cron: "0 3 * * 0", timezone: UTC}]
        parameters: {config_path: /shared/params.yaml, overrides: [], stages: null}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional
from uuid import UUID

import typer

from contract.config import RunConfig
from flows.cli_common import ConfigOption, console, load_or_exit
from flows.placement import STAGE_FLOW, stage_deployment_name, stage_pools
from flows.stages import STAGE_ORDER, select_stages


def deployment_parameters(config_path: Optional[Path], overrides: list[str], stages: Optional[list[str]],
                          place_stages: bool = False) -> dict[str, Any]:
    """The flow's parameters for every scheduled run; the config path is absolute (runs start elsewhere).
    `place_stages` only appears when the config places stages on work pools."""
    parameters: dict[str, Any] = {
        "config_path": str(config_path.resolve()) if config_path is not None else None,
        "overrides": list(overrides),
        "stages": stages,
    }
    if place_stages:
        parameters["place_stages"] = True
    return parameters


def serve_pipeline(cfg: RunConfig, cron: str, parameters: dict[str, Any]) -> None:
    """Create the deployment with its cron schedule and run its flow runs from this process until stopped."""
    from prefect.types.entrypoint import EntrypointType

    from flows.pipeline import pipeline

    pipeline.serve(name=cfg.deployment.name, cron=cron, parameters=parameters,
                   entrypoint_type=EntrypointType.MODULE_PATH)


def deploy_to_work_pool(cfg: RunConfig, cron: str, parameters: dict[str, Any], work_pool: str) -> UUID:
    """Register the deployment with `work_pool`; its workers import the flow from their installed eaglet."""
    from prefect.types.entrypoint import EntrypointType

    from flows.pipeline import pipeline

    return pipeline.deploy(name=cfg.deployment.name, work_pool_name=work_pool, cron=cron, parameters=parameters,
                           entrypoint_type=EntrypointType.MODULE_PATH, build=False, push=False,
                           print_next_steps=False, ignore_warnings=True)


def deploy_stage_flows(cfg: RunConfig) -> dict[str, UUID]:
    """Register one `eaglet-stage` deployment per pool of `deployment.work_pools` (no schedule: the pipeline's
    runs start them); returns each pool's deployment id."""
    from prefect.types.entrypoint import EntrypointType

    from flows.pipeline import placed_stage

    return {pool: placed_stage.deploy(name=stage_deployment_name(cfg, pool), work_pool_name=pool,
                                      entrypoint_type=EntrypointType.MODULE_PATH, build=False, push=False,
                                      print_next_steps=False, ignore_warnings=True)
            for pool in stage_pools(cfg)}


OverridesArgument = typer.Argument(None, help="Overrides as section.field=value (YAML values), kept for every run.")
CronOption = typer.Option(None, "--cron", help="Cron schedule, e.g. '0 3 * * 0' (default: deployment.cron).")
WorkPoolOption = typer.Option(None, "--work-pool", help="Register with this work pool instead of serving "
                              "(default: deployment.work_pool).")
StagesOption = typer.Option(None, "--stages", help="Comma-separated subset of stages for every run.")


def add_deploy_command(app: typer.Typer) -> None:
    """Add `eaglet deploy` to the CLI (flows/cli.py wires it in; this module keeps the work)."""
    app.command("deploy")(deploy)


def deploy(config: Optional[Path] = ConfigOption, overrides: Optional[list[str]] = OverridesArgument,
           cron: Optional[str] = CronOption, work_pool: Optional[str] = WorkPoolOption,
           stages: Optional[str] = StagesOption) -> None:
    """Schedule the pipeline: serve it from this process, or register it with a work pool."""

    cfg = load_or_exit(config, overrides)
    schedule = cron or cfg.deployment.cron
    if not schedule:
        console.print("[red]no schedule[/red]: pass --cron or set deployment.cron in the config")
        raise typer.Exit(code=2)
    try:
        selected = select_stages(stages.split(",")) if stages else None
    except KeyError as error:
        console.print(f"[red]{error.args[0]}[/red]")
        raise typer.Exit(code=2) from None
    parameters = deployment_parameters(config, overrides or [], selected, place_stages=bool(cfg.deployment.work_pools))
    for stage_pool, deployment_id in deploy_stage_flows(cfg).items():
        placed = [name for name in STAGE_ORDER if cfg.deployment.work_pools.get(name) == stage_pool]
        console.print(f"deployment {STAGE_FLOW}/{stage_deployment_name(cfg, stage_pool)} ({deployment_id}) on work "
                      f"pool {stage_pool}: stages {', '.join(placed)}")
    pool = work_pool or cfg.deployment.work_pool
    if pool:
        deployment_id = deploy_to_work_pool(cfg, schedule, parameters, pool)
        console.print(f"deployment eaglet-pipeline/{cfg.deployment.name} ({deployment_id}) on work pool {pool}, "
                      f"cron {schedule!r}")
        return
    console.print(f"serving deployment eaglet-pipeline/{cfg.deployment.name}, cron {schedule!r} (Ctrl-C stops)")
    serve_pipeline(cfg, schedule, parameters)
