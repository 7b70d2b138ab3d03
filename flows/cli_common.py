"""What every `eaglet` command module shares: the console, the config options, loading and checking a config.

flows/cli.py builds the app and imports the command modules (flows/deployments.py, flows/registry_cli.py);
they import this module, never flows/cli.py, so the CLI has no import circle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from contract.config import RunConfig
from contract.config_loading import ConfigError, load_config
from flows.preflight import Preflight, preflight

console = Console()

ConfigOption = typer.Option(None, "--config", "-c", help="Run config YAML (defaults when omitted).")
OverridesArgument = typer.Argument(None, help="Overrides as section.field=value (YAML values).")


def load_or_exit(config: Optional[Path], overrides: Optional[list[str]]) -> RunConfig:
    """Load the config, or print the problems and exit with status 2."""
    try:
        return load_config(config, overrides or [])
    except ConfigError as error:
        console.print(f"[red]config error[/red]: {error}", markup=True, highlight=False)
        raise typer.Exit(code=2) from None


def check_or_exit(cfg: RunConfig, config: Optional[Path]) -> Preflight:
    """Check the config against this machine and its target (flows/preflight.py) before anything runs, or
    print every problem and exit with status 2."""
    report = preflight(cfg)
    if report.problems:
        listing = "\n".join(f"  - {escape(problem)}" for problem in report.problems)
        console.print(f"[red]config error[/red]: {escape(str(config or '<defaults>'))}: this run cannot start "
                      f"here:\n{listing}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(code=2)
    return report
