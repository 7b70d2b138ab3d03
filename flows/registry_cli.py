"""`eaglet promote`, `eaglet registry show` and `eaglet doctor`: the registry and checkpoint commands.

    eaglet registry show --config params.yaml
    eaglet promote --version 3 --config params.yaml
    eaglet promote --version 2 --force --reason "gates measured on a stale eval set" --config params.yaml
    eaglet doctor artifacts/embedded-default/draft --target artifacts/embedded-default/target

flows/cli.py adds them with `add_registry_commands(app)`. The work is in tasks/register.py; these only load
the config, call it and print.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flows.cli_common import ConfigOption, OverridesArgument, load_or_exit


def add_registry_commands(app: typer.Typer) -> None:
    """Add `promote`, `doctor` and the `registry` group (`show`) to the eaglet app."""
    registry_app = typer.Typer(help="The registered drafter: versions, aliases, gates.", no_args_is_help=True)
    registry_app.command("show")(registry_show)
    app.add_typer(registry_app, name="registry")
    app.command("promote")(promote)
    app.command("doctor")(doctor)


def make_console() -> Console:
    """A console per command, so the terminal width (COLUMNS) is read when the command runs."""
    return Console(soft_wrap=True)


def registry_show(config: Optional[Path] = ConfigOption, overrides: Optional[list[str]] = OverridesArgument) -> None:
    """Table of the registered versions: aliases, method, offline accept length, speedup, gates (passed, and which were
    waived), target revision."""
    from mlflow.exceptions import MlflowException

    from tasks.registry.store import registry_client, version_rows

    cfg = load_or_exit(config, overrides)
    name = cfg.registry.model_name
    console = make_console()
    client = registry_client(cfg)
    try:
        rows = version_rows(client, name)
    except MlflowException:
        console.print(f"no registered model '{escape(name)}' in {escape(client.tracking_uri)}: run the register stage")
        raise typer.Exit(code=1) from None
    table = Table(title=f"{name} ({client.tracking_uri})")
    for column in ("version", "aliases", "method", "offline accept length", "speedup", "gates passed", "waived gates",
                   "target revision", "created"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(escape(value) for value in row.values()), style="bold green" if "champion" in row["aliases"] else None)
    console.print(table)


def promote(
    version: int = typer.Option(..., "--version", help="The model version to make champion."),
    force: bool = typer.Option(False, "--force", help="Promote although its gates failed (needs --reason)."),
    reason: Optional[str] = typer.Option(None, "--reason", help="Why (recorded as the version tag eaglet.promotion_reason)."),
    config: Optional[Path] = ConfigOption,
    overrides: Optional[list[str]] = OverridesArgument,
) -> None:
    """Make a version champion if its gates passed (or --force --reason); the old champion becomes previous."""
    from mlflow.exceptions import MlflowException

    from tasks.registry.promotion_lock import promotion_lock
    from tasks.registry.store import registry_client

    console = make_console()
    if force and not (reason and reason.strip()):
        console.print("[red]--force needs --reason[/red]: say why the gates are overruled (it is recorded)")
        raise typer.Exit(code=2)
    cfg = load_or_exit(config, overrides)
    name = cfg.registry.model_name
    client = registry_client(cfg)
    try:
        tags = client.get_model_version(name, str(version)).tags
    except MlflowException:
        console.print(f"[red]no version {version} of '{escape(name)}'[/red] in {escape(client.tracking_uri)}")
        raise typer.Exit(code=2) from None
    # The lock a registering run holds from reading the champion to moving it: a hand promotion does not land
    # between a run's comparison and its alias move (tasks/registry/promotion_lock.py).
    with promotion_lock(client.tracking_uri, name):
        promote_unlocked(console, client, name, version, tags, force, reason)


def promote_unlocked(console: Console, client: Any, name: str, version: int, tags: dict[str, str], force: bool,
                     reason: Optional[str]) -> None:
    """`eaglet promote`'s checks and alias move, under the registry's promotion lock."""
    from tasks.registry.store import CHAMPION, TAG_FAILED_GATES, TAG_GATES_PASSED, alias_version, promote_version

    if alias_version(client, name, CHAMPION) == version:
        console.print(f"{escape(name)} v{version} is already champion")
        return
    if tags.get(TAG_GATES_PASSED) != "true" and not force:
        failed = json.loads(tags.get(TAG_FAILED_GATES, "[]"))
        console.print(f"[red]{escape(name)} v{version} did not pass its gates[/red]; it stays candidate:")
        for line in failed or ["(no gate verdicts recorded on this version)"]:
            console.print(f"  - {escape(line)}")
        console.print("promote it anyway with --force --reason TEXT")
        raise typer.Exit(code=1)
    previous = promote_version(client, name, version, reason=reason, forced=force)
    moved = f"; v{previous} is now 'previous'" if previous is not None else ""
    console.print(f"[green]{escape(name)} v{version} is champion[/green]{moved}")


def doctor(
    directory: Path = typer.Argument(..., help="A checkpoint directory (an engine export, or draft/ with both)."),
    target: Path = typer.Option(..., "--target", "-t", help="The target: a run's target/ dir or output dir, a "
                                "target.json, or an HF model directory."),
) -> None:
    """Run the contract checks (docs/architecture.md §3, §5) on a checkpoint for a target; exit 1 on any failure."""
    from tasks.registry.doctor import doctor as run_checks

    console = make_console()
    try:
        results = run_checks(directory, target)
    except FileNotFoundError as error:
        console.print(f"[red]{escape(str(error))}[/red]")
        raise typer.Exit(code=2) from None
    failures = 0
    for export, checks in results.items():
        console.print(f"[bold]{escape(str(export))}[/bold]")
        for check in checks:
            verdict = "[green]ok    [/green]" if check.ok else "[red]FAILED[/red]"
            console.print(f"  {verdict} {escape(check.field)}: {escape(check.detail)}")
            failures += not check.ok
    if failures:
        console.print(f"[red]{failures} check(s) failed[/red]")
        raise typer.Exit(code=1)
    console.print("[green]all checks passed[/green]")
