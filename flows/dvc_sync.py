"""`eaglet dvc sync`: rewrite dvc.yaml's `deps` and `params` from the declarations the Prefect cache key reads.

    eaglet dvc sync            # rewrite dvc.yaml in place
    eaglet dvc sync --check    # exit 1 naming each stage whose lists differ (CI)

Per stage, `deps` become the upstream artifacts dvc.yaml already lists (`${output_dir}/...`, kept) plus the code
tasks/common/stage_code.py derives from the stage's imports, sorted; `params` become flows/stages.py STAGE_READS. Only
those two lists are rewritten, line by line, so comments, cmd, outs, metrics and plots stay as written.
"""

from __future__ import annotations

import re
from pathlib import Path

import typer
import yaml

from flows.cli_common import console
from flows.stage_cache import DVC_FILE, OUTPUT_DIR_VARIABLE, entry_names
from tasks.common.stage_code import stage_code_deps
from flows.stages import STAGE_ORDER, stage_reads

SYNC_COMMAND = "eaglet dvc sync"
STAGE_INDENT, KEY_INDENT, ITEM_INDENT = "  ", "    ", "      "


class DvcFileError(ValueError):
    """dvc.yaml lacks the structure to rewrite (a stage or its list is missing)."""


def declared_lists(name: str, body: dict) -> dict[str, list[str]]:
    """What stage `name`'s `deps` and `params` must say."""
    data_deps = [dep for dep in entry_names(body.get("deps", [])) if dep.startswith(OUTPUT_DIR_VARIABLE)]
    return {"deps": sorted([*data_deps, *stage_code_deps(name)]), "params": list(stage_reads(name).params)}


def list_span(lines: list[str], stage: str, key: str) -> tuple[int, int]:
    """Line range [start, end) of the items of `key:` inside stage `stage` of dvc.yaml."""
    header = re.compile(rf"^{STAGE_INDENT}{re.escape(stage)}:\s*(#.*)?$")
    start = next((number for number, line in enumerate(lines) if header.match(line)), None)
    if start is None:
        raise DvcFileError(f"dvc.yaml has no stage '{stage}' (a line '{STAGE_INDENT}{stage}:' under stages:)")
    for number in range(start + 1, len(lines)):
        line = lines[number]
        if line.strip() and not line.startswith(KEY_INDENT):
            break
        if line.rstrip() == f"{KEY_INDENT}{key}:":
            end = number + 1
            while end < len(lines) and lines[end].startswith(ITEM_INDENT):
                end += 1
            return number + 1, end
    raise DvcFileError(f"dvc.yaml stage '{stage}' has no '{key}:' list to rewrite; add '{KEY_INDENT}{key}:' under it")


def synced_text(text: str) -> str:
    """dvc.yaml's text with every stage's `deps` and `params` as declared, the rest untouched."""
    stages = yaml.safe_load(text)["stages"]
    lines = text.splitlines(keepends=True)
    for name in STAGE_ORDER:
        if name not in stages:
            raise DvcFileError(f"dvc.yaml has no stage '{name}'; every stage of flows/stages.py STAGE_ORDER needs one")
        for key, items in declared_lists(name, stages[name]).items():
            start, end = list_span(lines, name, key)
            lines[start:end] = [f"{ITEM_INDENT}- {item}\n" for item in items]
    return "".join(lines)


def stale_stages(text: str) -> list[str]:
    """Stages whose `deps` or `params` in `text` differ from the declared ones, as `stage.key` names."""
    written, wanted = yaml.safe_load(text)["stages"], yaml.safe_load(synced_text(text))["stages"]
    return [f"{name}.{key}" for name in STAGE_ORDER for key in ("deps", "params")
            if written[name].get(key) != wanted[name].get(key)]


CheckOption = typer.Option(False, "--check", help="Change nothing; exit 1 if dvc.yaml is out of date.")


def sync(check: bool = CheckOption) -> None:
    """Rewrite dvc.yaml's deps (the code each stage imports) and params (STAGE_READS) from their declarations."""
    path: Path = DVC_FILE
    text = path.read_text(encoding="utf-8")
    stale = stale_stages(text)
    if check:
        if stale:
            console.print(f"{path} is out of date ({', '.join(stale)}): run `{SYNC_COMMAND}`", markup=False)
            raise typer.Exit(code=1)
        console.print(f"{path} is up to date", markup=False)
        return
    path.write_text(synced_text(text), encoding="utf-8")
    console.print(f"rewrote {path}: {', '.join(stale) if stale else 'nothing changed'}", markup=False)


def add_dvc_commands(app: typer.Typer) -> None:
    """Add `eaglet dvc sync` to the CLI (flows/cli.py wires it in; this module keeps the work)."""
    dvc_app = typer.Typer(help="Keep dvc.yaml in step with the code and STAGE_READS.", no_args_is_help=True)
    dvc_app.command("sync")(sync)
    app.add_typer(dvc_app, name="dvc")
