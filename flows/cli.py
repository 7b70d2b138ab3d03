"""The `eaglet` command line: every subcommand is a thin, typed wrapper over a plain function.

    eaglet config show --config params.yaml training.learning_rate=3e-4
    eaglet config validate --config configs/llama31-8b-sglang.yaml
    eaglet config validate --schema-only --config configs/llama31-8b-sglang.yaml   # on a laptop: no host checks
    eaglet config sources --config params.yaml        # data/sources.json: the source files by content (DVC)
    eaglet config reference --write                   # docs/configuration.md's field tables from contract/config.py
    eaglet stage target --config params.yaml          # one stage, no Prefect (what dvc.yaml calls)
    eaglet train --config params.yaml                  # the same, by the stage's own name
    eaglet run --config params.yaml                    # the Prefect flow over every stage (unchanged ones cached)
    eaglet deploy --config params.yaml --cron "0 3 * * 0"   # a scheduled deployment (see flows/deployments.py)
    eaglet registry show --config params.yaml          # versions, aliases, gates
    eaglet promote --version 3 --config params.yaml    # [--force --reason "..."]
    eaglet doctor artifacts/embedded-default/draft/sglang --target artifacts/embedded-default/target
    eaglet serve --alias champion --config params.yaml # serve the champion on vLLM ([--print]: the command only)
    eaglet dvc sync                                    # dvc.yaml's deps and params from the code (flows/dvc_sync.py)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import NoReturn, Optional

import typer
from rich.markup import escape
from rich.table import Table

from contract.config import RunConfig
from contract.config_loading import config_as_yaml
from flows.cli_common import ConfigOption, OverridesArgument, check_or_exit, console, load_or_exit
from flows.preflight import HOST_CHECKS
from flows.deployments import add_deploy_command
from flows.dvc_sync import add_dvc_commands
from flows.registry_cli import add_registry_commands
from flows.serve_cli import add_serve_command
from flows.stages import STAGE_ORDER
from tasks.common.run_lock import RunLocked, output_dir_lock

for variable, value in (("PREFECT_SERVER_ANALYTICS_ENABLED", "false"), ("GX_ANALYTICS_ENABLED", "false"),
                        ("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(variable, value)

app = typer.Typer(help="eaglet: build, validate and ship EAGLE3 draft models.", no_args_is_help=True)
config_app = typer.Typer(help="Inspect and check run configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")
add_registry_commands(app)
add_deploy_command(app)
add_dvc_commands(app)
add_serve_command(app)


@config_app.command("show")
def config_show(config: Optional[Path] = ConfigOption, overrides: Optional[list[str]] = OverridesArgument) -> None:
    """Print the resolved config (defaults filled in, overrides applied)."""
    sys.stdout.write(config_as_yaml(load_or_exit(config, overrides)))


@config_app.command("validate")
def config_validate(
    config: Optional[Path] = ConfigOption,
    overrides: Optional[list[str]] = OverridesArgument,
    schema_only: bool = typer.Option(False, "--schema-only", help="Check the fields and the rules between them "
                                     "only, not this machine or the target (a cluster config on a laptop)."),
) -> None:
    """Check a config, and it against this machine and its target; exit 2 naming every bad field."""
    cfg = load_or_exit(config, overrides)
    print_evaluation_plan(cfg)
    if schema_only:
        console.print(f"[yellow]not checked (--schema-only)[/yellow]: {escape(HOST_CHECKS)}", highlight=False,
                      soft_wrap=True)
        console.print(f"[green]ok[/green]: {config or '<defaults>'} is a valid run config on paper (run_id {cfg.run_id})",
                      soft_wrap=True)
        return
    report = check_or_exit(cfg, config)
    for unchecked in report.not_checked:
        console.print(f"[yellow]not checked yet[/yellow]: {escape(unchecked)}", highlight=False, soft_wrap=True)
    console.print(f"[green]ok[/green]: {config or '<defaults>'} is a valid run config (run_id {cfg.run_id})")


def print_evaluation_plan(cfg: RunConfig) -> None:
    """The evaluation's size and estimated time (flows/evaluation_plan.py), so an unbounded one is seen on paper."""
    from flows.evaluation_plan import evaluation_plan

    for line in evaluation_plan(cfg).lines():
        console.print(line, markup=False, highlight=False, soft_wrap=True)


@config_app.command("sources")
def config_sources(config: Optional[Path] = ConfigOption, overrides: Optional[list[str]] = OverridesArgument) -> None:
    """Write <output_dir>/data/sources.json: each data source's file by content (DVC's `sources` stage runs this
    on every repro, so an edited source file reruns ingest)."""
    from tasks.common.artifacts import write_json
    from tasks.data.sources import source_fingerprints

    cfg = load_or_exit(config, overrides)
    fingerprints = source_fingerprints(cfg)
    path = cfg.output_path / "data" / "sources.json"
    write_json(path, fingerprints)
    for name, fingerprint in fingerprints.items():
        console.print(f"{name}: {fingerprint}", markup=False, highlight=False)
    console.print(f"wrote {path}", markup=False, highlight=False)


@config_app.command("reference")
def config_reference(
    write: bool = typer.Option(False, "--write", help="Rewrite the generated block of docs/configuration.md."),
) -> None:
    """Print every config field with its type, default and description, rendered from contract/config.py."""
    from contract import config_reference as reference

    if write:
        changed = reference.write()
        console.print(f"{'wrote' if changed else 'unchanged'}: {reference.DOC_PATH}", markup=False, highlight=False)
    else:
        sys.stdout.write(reference.render())


@app.command("stage")
def stage(
    name: str = typer.Argument(..., help="Stage name (target, ingest, ...)."),
    config: Optional[Path] = ConfigOption,
    overrides: Optional[list[str]] = OverridesArgument,
) -> None:
    """Run one stage's function directly (DVC calls this)."""
    from flows.stages import stage_function
    from flows.tracking import tracked_run

    cfg = load_or_exit(config, overrides)
    try:
        function = stage_function(name)
    except KeyError as error:
        console.print(f"[red]{error.args[0]}[/red]")
        raise typer.Exit(code=2) from None
    check_or_exit(cfg, config)
    try:
        with output_dir_lock(cfg.output_path, f"eaglet stage {name}"):
            with tracked_run(cfg, run_name=f"{cfg.run_id}/{name}", tags={"eaglet.kind": "stage", "eaglet.stage": name}) as tracker:
                result = function(cfg)
                tracker.log_stage(name, result)
    except RunLocked as error:
        refuse(f"stage {name}", error)
    except stage_errors() as error:
        console.print(f"[red]stage {name} failed[/red]: {error}", markup=True, highlight=False)
        raise typer.Exit(code=1) from None
    print_summaries({name: result.summary()})


@app.command("train")
def train_command(
    config: Optional[Path] = ConfigOption,
    overrides: Optional[list[str]] = OverridesArgument,
) -> None:
    """Train the drafter (torchrun when deployment.trainer has more than one rank; several nodes: see docs/stages.md).
    A rerun continues the newest matching checkpoint (training.resume_from, auto by default)."""
    stage("train", config, overrides)


def stage_command(name: str) -> None:
    """`eaglet NAME`: the stage NAME by its own name (same as `eaglet stage NAME`)."""

    def command(config: Optional[Path] = ConfigOption, overrides: Optional[list[str]] = OverridesArgument) -> None:
        stage(name, config, overrides)

    command.__doc__ = f"Run the {name} stage (same as `eaglet stage {name}`)."
    app.command(name)(command)


def refuse(what: str, error: RunLocked) -> NoReturn:
    """Another run holds the output_dir: one red line naming it, exit 1, no traceback."""
    console.print(f"[red]{what} refused[/red]: {escape(str(error))}", markup=True, highlight=False, soft_wrap=True)
    raise typer.Exit(code=1) from None


def stage_errors() -> tuple[type[Exception], ...]:
    """Errors whose message says all a person needs: printed without a traceback."""
    from contract.checkpoint import ContractMismatch
    from contract.secrets import SecretUnavailable
    from tasks.common.assets import AssetMissing
    from tasks.benchmark import BenchmarkFailed
    from tasks.serving.engine import EngineStartError
    from tasks.evaluate import GreedyMismatch
    from tasks.train import TrainingDiverged, TrainingFailed
    from tasks.training.checkpoint import ResumeRefused

    return (AssetMissing, BenchmarkFailed, ContractMismatch, EngineStartError, GreedyMismatch, ResumeRefused,
            SecretUnavailable, TrainingDiverged, TrainingFailed, FileNotFoundError)


@app.command("run")
def run(
    config: Optional[Path] = ConfigOption,
    overrides: Optional[list[str]] = OverridesArgument,
    stages: Optional[str] = typer.Option(None, "--stages", help="Comma-separated subset of stages."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Run every stage, even those whose inputs are unchanged."),
) -> None:
    """Run the pipeline as a Prefect flow (every stage, or --stages); stages with unchanged inputs are reused."""
    from flows.pipeline import pipeline

    cfg = load_or_exit(config, overrides)
    check_or_exit(cfg, config)
    selected = stages.split(",") if stages else None
    try:  # locked here too (the flow nests in it), so a refusal is one line, not a failed flow run
        with output_dir_lock(cfg.output_path, f"eaglet run ({stages or 'all stages'})"):
            summaries = pipeline(str(config) if config else None, overrides or [], selected, use_cache=not no_cache)
    except RunLocked as error:
        refuse("run", error)
    print_summaries(summaries)
    print_where_things_are(cfg)
    print_roofline(cfg, summaries)


def print_roofline(cfg: RunConfig, summaries: dict[str, dict[str, float]]) -> None:
    """The last lines of a run: how much of this host's matmul peak each compute stage used (tasks/common/roofline.py),
    written beside the run and logged to its MLflow run; a run it cannot be computed for says why in one line."""
    from flows.tracking import log_to_pipeline_run
    from tasks.common.roofline import RooflineUnavailable, write_roofline

    try:
        roofline = write_roofline(cfg, summaries)
        console.print(roofline.table, soft_wrap=True, markup=False, highlight=False)
        log_to_pipeline_run(cfg, [roofline.json_path, roofline.png_path], "roofline")
    except RooflineUnavailable as error:
        console.print(f"roofline: not computed: {error}", soft_wrap=True, markup=False, highlight=False)


def print_where_things_are(cfg: RunConfig) -> None:
    """The end of a run: where a person looks next (Data Docs, reports, MLflow UI, the champion)."""
    out = cfg.output_path.resolve()
    lines = [("artifacts", str(out))]
    data_docs = out / "reports" / "data_docs" / "index.html"
    if data_docs.is_file():
        lines.append(("Data Docs", data_docs.as_uri()))
    for label, relative in (("data contract", "reports/data_contract.json"), ("acceptance", "evaluate/acceptance.json"),
                            ("serving", "benchmark/report.json"), ("registration", "register/registration.json")):
        if (out / relative).is_file():
            lines.append((label, str(out / relative)))
    if cfg.tracking.enabled:
        from tasks.common.mlflow_store import tracking_uri

        lines.append(("MLflow UI", f"mlflow ui --backend-store-uri {tracking_uri(cfg)}"))
    registration = out / "register" / "registration.json"
    if registration.is_file():
        lines.append(("champion", champion_line(cfg, json.loads(registration.read_text()))))
    for label, text in lines:  # paths are copied from here: never wrapped
        console.print(f"{label + ':':<15}{text}", soft_wrap=True, markup=False, highlight=False)


def champion_line(cfg: RunConfig, registration: dict) -> str:
    """Which version is champion after this run, with the gates it was let through unmeasured, and if this run's
    version is not champion, which gates withheld it (failed, or not run without a waiver)."""
    name = registration.get("model_name", cfg.registry.model_name)
    version = registration.get("version")
    if version is None:
        return f"not registered ({registration.get('skipped', 'no version')})"
    if "champion" in registration.get("aliases", []):
        waived = registration.get("waived_gates", [])
        note = f"; waived: {', '.join(waived)}" if waived else ""
        return f"models:/{name}@champion = version {version} (this run{note})"
    held_back = "; ".join(registration.get("failed_gates", [])) or "see registration.json"
    before = registration.get("champion_before")
    current = f"version {before}" if before else "none yet"
    return (f"models:/{name}@champion = {current}; this run's version {version} stays candidate "
            f"({held_back}); eaglet promote --version {version} --force --reason '...' overrides")


@app.command("inspect")
def inspect(
    sample_id: str = typer.Argument(..., help="Record id, e.g. sharegpt:identity_0"),
    config: Optional[Path] = ConfigOption,
    overrides: Optional[list[str]] = OverridesArgument,
    features: bool = typer.Option(False, "--features", help="Add the captured feature row and the teacher's token."),
) -> None:
    """Print one record after templating: position | token id | token | loss_mask (| feature row | teacher)."""
    from tasks.common.target_info import load_tokenizer
    from tasks.features.inspector import find_record, inspection_rows

    cfg = load_or_exit(config, overrides)
    try:
        record, path = find_record(cfg, sample_id)
        captured = feature_table_rows(cfg, sample_id) if features else None
    except KeyError as error:
        console.print(f"[red]{error.args[0]}[/red]")
        raise typer.Exit(code=2) from None
    tokenizer = load_tokenizer(cfg.output_path / "target", cfg.model)
    rows = inspection_rows(tokenizer, record, cfg.validation.max_length, cfg.validation.cut_turns, sample_id)
    table = Table(title=f"{sample_id} ({path.name})")
    columns = ["position", "token id", "token", "loss_mask"]
    if captured is not None:
        columns += ["row", "teacher"]
    for column in columns:
        table.add_column(column)
    for row in rows:
        cells = [str(row.position), str(row.token_id), repr(row.token), str(row.loss_mask)]
        if captured is not None:
            feature = captured[row.position]
            if feature.token_id != row.token_id:
                console.print(f"[red]feature row {feature.row} holds token {feature.token_id}, expected {row.token_id}[/red]")
                raise typer.Exit(code=1)
            cells += [str(feature.row), f"{feature.teacher_id} {tokenizer.decode([feature.teacher_id])!r}"]
        table.add_row(*cells, style="bold green" if row.loss_mask else None)
    console.print(table)
    console.print(f"{sum(row.loss_mask for row in rows)} supervised of {len(rows)} tokens")
    if captured is not None:
        console.print("row: the feature row of the token; teacher: the target's top-1 after it. Draft step 0 at position t: "
                      "hidden of row t, embedding of token t+1, learns the teacher of row t+1.")


def feature_table_rows(cfg: RunConfig, sample_id: str) -> list:
    """Captured rows of a record, with the teacher's top-1 per row."""
    from models.target_loading import load_target
    from tasks.features.inspector import feature_rows, find_feature_record

    record, _ = find_feature_record(cfg.output_path / "features", sample_id)
    lm_head = None
    if "hidden_state" in record:
        model, _ = load_target(cfg.output_path / "target", "float32", cfg.model.trust_remote_code)
        lm_head = model.get_output_embeddings().weight
    return feature_rows(record, lm_head)


def print_summaries(summaries: dict[str, dict[str, float]]) -> None:
    table = Table(title="stages")
    table.add_column("stage")
    table.add_column("summary")
    for name, summary in summaries.items():
        table.add_row(name, ", ".join(f"{key}={value:g}" for key, value in summary.items()))
    console.print(table)


for stage_name in STAGE_ORDER:
    if stage_name != "train":  # train has its own command (its help says how it resumes)
        stage_command(stage_name)

if __name__ == "__main__":
    app()
