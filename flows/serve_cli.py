"""`eaglet serve`: serve a registered drafter version with the run's target on vLLM or SGLang.

    eaglet serve --config params.yaml                          # the champion on vLLM, until Ctrl-C
    eaglet serve --config params.yaml --version 3 --engine sglang --port 30001
    eaglet serve --config params.yaml --alias champion --print # the command line (and env) only, nothing starts

flows/cli.py adds it with `add_serve_command(app)`. The work is in tasks/serving/serve_version.py; this only loads
the config, calls it and prints.
"""

from __future__ import annotations

import signal
import sys
import threading
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape

from flows.cli_common import ConfigOption, OverridesArgument, console, load_or_exit


class Engine(str, Enum):
    vllm = "vllm"
    sglang = "sglang"


def add_serve_command(app: typer.Typer) -> None:
    """Add `serve` to the eaglet app."""
    app.command("serve")(serve_command)


def serve_command(
    alias: Optional[str] = typer.Option(None, "--alias", help="Serve the version holding this alias (default "
                                        "champion)."),
    version: Optional[int] = typer.Option(None, "--version", help="Serve this version number instead of an alias."),
    engine: Engine = typer.Option(Engine.vllm, "--engine", help="The engine (runtime.engines.<engine>: python, port, "
                                  "extra_args, env, dtype, enforce_eager, gpus)."),
    port: Optional[int] = typer.Option(None, "--port", help="Listen on this port instead of runtime.engines.<engine>"
                                       ".port."),
    print_only: bool = typer.Option(False, "--print", help="Print the engine's command line and the env it sets "
                                    "(CUDA_VISIBLE_DEVICES from gpus); start nothing."),
    config: Optional[Path] = ConfigOption,
    overrides: Optional[list[str]] = OverridesArgument,
) -> None:
    """Serve a registered drafter version (default: the champion) with the run's target, in the foreground until
    Ctrl-C: its export for the engine, the setting its benchmark recommended, the benchmark's command builder."""
    from mlflow.exceptions import MlflowException

    from contract.checkpoint import ContractMismatch
    from contract.secrets import SecretUnavailable
    from tasks.serving.engine import EngineStartError
    from tasks.serving.serve_version import ServeRefused, launch_text, served_version

    if alias is not None and version is not None:
        console.print("[red]--alias and --version name a version each[/red]: give one")
        raise typer.Exit(code=2)
    cfg = load_or_exit(config, overrides)
    kind = engine.value
    try:
        served = served_version(cfg, kind, alias=alias or "champion", version=version, port=port)
    except (ServeRefused, ContractMismatch, SecretUnavailable, LookupError, FileNotFoundError,
            MlflowException) as error:
        console.print(f"[red]cannot serve[/red]: {escape(str(error))}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1) from None
    which = f"alias '{alias or 'champion'}'" if version is None else "by number"
    header = (f"{served.model_name} v{served.version} ({which}) on {kind}: {served.setting.label} from "
              f"{served.setting_source}")
    if print_only:
        typer.echo(f"# {header}\n# export: {served.export}\n{launch_text(served.launch, f'runtime.engines.{kind}.env')}")
        return
    console.print(escape(header), highlight=False, soft_wrap=True)
    console.print(f"starting {kind} (log: {escape(str(served.launch.log_path))}) ...", highlight=False, soft_wrap=True)
    stop_on_sigterm()
    try:
        code = serve_until_interrupted(served)
    except EngineStartError as error:
        console.print(f"[red]the engine did not start[/red]: {escape(str(error))}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=1) from None
    if code:
        console.print(f"[red]{kind} exited by itself (code {code})[/red]; log: {escape(str(served.launch.log_path))}",
                      highlight=False, soft_wrap=True)
        raise typer.Exit(code=1)
    console.print("stopped", highlight=False)


def serve_until_interrupted(served: Any) -> int:
    """Run the engine in the foreground, saying where it answers once it is ready."""
    from tasks.serving.serve_version import serve_in_foreground

    def ready(engine: Any) -> None:
        console.print(f"[green]ready[/green]: base URL {engine.base_url}  model '{served.launch.served_model_name}'  "
                      f"(pid {engine.pid}; Ctrl-C stops it)", highlight=False, soft_wrap=True)

    return serve_in_foreground(served.launch, ready)


def stop_on_sigterm() -> None:
    """SIGTERM (a process manager stopping us) unwinds like Ctrl-C, so the engine's process group is stopped too."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
