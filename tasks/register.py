"""register stage: the exported drafter becomes an MLflow model version, promoted only through the gates.

Reads the exports `draft/sglang` and `draft/vllm` (checked against `target.json` first, as `eaglet doctor`
does), `evaluate/acceptance.json`, and when they exist `benchmark/report.json`, `reports/data_contract.json`
and the Data Docs `reports/data_docs/index.html`. Missing exports or evaluation fail the stage naming the
file and the stage to run; a failed gate does not: the version is registered and keeps alias `candidate`.
Neither does a gate that could not be measured (no engine ran; a champion measured on another eval set or target
revision): it withholds `champion` the same way unless `registry.waive_gates` names it with the reason it cannot be
measured (kept, for the gates it let through, as the version's `eaglet.waivers` tag). The stage reports are read
through contract/reports.py, so a report missing a field fails naming the file and the field.

MLflow 3 (docs/architecture.md §7): the checkpoint folder is a logged model (`initialize_logged_model`, the two engine
folders, `contract.json` and the reports as its artifacts, `finalize_logged_model`), registered under
`registry.model_name` with the full contract (docs/architecture.md §5) as version tags, plus the eval-set fingerprint,
the git commit and the hash of dvc.lock's upstream stages. Aliases, never stages: every new version gets
`candidate`; one whose gates pass (tasks/registry/gates.py) becomes `champion` and the champion it replaces
keeps `previous`; reading the champion, gating and moving the alias happen under the registry's promotion lock
(tasks/registry/promotion_lock.py), so two runs registering at once cannot both replace one champion. Runs inside the
pipeline's MLflow run when there is one, else in its own. With
`tracking.enabled: false` (CI-size runs) there is no store: the gates are evaluated and reported, nothing
is registered.

Writes `register/registration.json` (version, aliases, each gate with its measured value and threshold, the gates
that withheld `champion` and the ones waived, with the waivers' reasons, and how the promotion was kept from racing
another run's: `promotion_guard`, and `promotion_refused` when the champion moved after the comparison).

    .venv/bin/eaglet stage register --config params.yaml
    .venv/bin/eaglet registry show --config params.yaml
    .venv/bin/eaglet promote --version 3 --config params.yaml [--force --reason "..."]
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from contract.chat_rendering import is_supervised
from contract.checkpoint import ENGINES, EXPORT_FILES, CheckpointContract, ContractMismatch
from contract.config import RunConfig
from contract.hashing import hash_text
from contract.records import PromptRecord
from contract.reports import AcceptanceReport, BenchmarkReport, load_report
from tasks.common.artifacts import read_json, write_json
from tasks.registry.doctor import inspect_checkpoint
from tasks.registry.gates import (Gate, GateInputs, blocking_lines, evaluate_gates, gates_passed, offline_accept_length,
                                  speedup_row, waived_names, waivers_used)
from tasks.registry.promotion_lock import promotion_lock
from tasks.registry.store import (CANDIDATE, CHAMPION, TAG_ACCEPT_LENGTH, TAG_EVAL_FINGERPRINT, TAG_FAILED_GATES,
                                  TAG_GATES, TAG_GATES_PASSED, TAG_RECOMMENDED_SERVING, TAG_SPEEDUP, TAG_WAIVERS,
                                  Promotion, aliases_of, current_champion, promote_if_unchanged)

ACCEPTANCE_REPORT = Path("evaluate") / "acceptance.json"
SERVING_REPORT = Path("benchmark") / "report.json"
DATA_CONTRACT_REPORT = Path("reports") / "data_contract.json"
DATA_DOCS_INDEX = Path("reports") / "data_docs" / "index.html"
REGISTRATION_REPORT = Path("register") / "registration.json"
STAGE = "register"

CONTRACT_TAG_PREFIX = "contract."


@dataclass
class RegisterInputs:
    """What the stage registers: the exports, their contract and target, and the reports (None: absent)."""

    exports: dict[str, Path]
    contract: CheckpointContract
    target_info: dict[str, Any]
    acceptance: AcceptanceReport
    serving: Optional[BenchmarkReport]
    data_contract: Optional[dict[str, Any]]
    report_paths: dict[str, Optional[Path]]


@dataclass
class RegisterResult:
    registration_path: Path
    registration: dict[str, Any]

    def summary(self) -> dict[str, float]:
        """Numbers for MLflow: which version (when registered), whether it passed, whether it is champion now."""
        registration = self.registration
        numbers = {
            "registered": float(registration["version"] is not None),
            "gates_passed": float(registration["gates_passed"]),
            "gates_failed": float(sum(gate["status"] == "failed" for gate in registration["gates"])),
            "champion": float(CHAMPION in registration["aliases"]),
            "offline_accept_length": float(registration["offline_accept_length"] or 0.0),
        }
        if registration["version"] is not None:
            numbers["version"] = float(registration["version"])
        return numbers

    def reports(self) -> list[Path]:
        return [self.registration_path]


def run(cfg: RunConfig) -> RegisterResult:
    """Register the run's drafter, gate it, and move the aliases; write register/registration.json."""
    out = cfg.output_path
    inputs = read_inputs(cfg)
    refuse_broken_exports(inputs, out)
    fingerprint = eval_fingerprint(cfg, inputs.acceptance)
    provenance = provenance_tags(cfg, inputs, Path.cwd())
    if cfg.tracking.enabled:
        with registration_run(cfg) as active:
            registration = register_and_gate(cfg, inputs, fingerprint, provenance, active)
    else:
        registration = gate_only(cfg, inputs, fingerprint, provenance)
    path = out / REGISTRATION_REPORT
    write_json(path, registration)
    say_gates(registration)
    return RegisterResult(path, registration)


def register_and_gate(cfg: RunConfig, inputs: RegisterInputs, fingerprint: str, provenance: dict[str, str],
                      active: Any) -> dict[str, Any]:
    """Gate against the current champion, log and register the drafter as candidate, promote it if it passed;
    returns what registration.json holds. From reading the champion to moving the alias the registry's promotion
    lock is held (tasks/registry/promotion_lock.py), so a run registering at the same time waits and is then gated
    against the champion this one leaves; where no lock is shared, the move is a compare-and-set."""
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient()
    name = cfg.registry.model_name
    with promotion_lock(mlflow.get_registry_uri(), name) as guard:
        champion = current_champion(client, name)
        gates = evaluate_gates(GateInputs(inputs.acceptance, inputs.serving, inputs.data_contract,
                                          inputs.contract.target_revision, fingerprint, champion), cfg.registry)
        contract = registered_contract(cfg, inputs, gates, fingerprint)
        model_id = log_drafter(client, inputs, contract, active)
        tags = {**contract_tags(contract), **gate_tags(cfg, inputs, gates, fingerprint), **provenance}
        version = register_version(name, model_id, tags)
        client.set_registered_model_alias(name, CANDIDATE, str(version))
        promotion = Promotion(False)
        if gates_passed(gates):
            promotion = promote_if_unchanged(client, name, version, champion.version if champion else None)
    registered = {
        "model_name": name, "version": version, "model_uri": f"models:/{name}/{version}", "model_id": model_id,
        "mlflow_run_id": active.info.run_id, "aliases": aliases_of(client, name, version),
        "champion_before": champion.version if champion else None, "previous_champion": promotion.previous,
        "promotion_guard": guard.describe(), "promotion_refused": promotion.refused,
    }
    return {**registered, **gate_record(cfg, inputs, gates, fingerprint, provenance)}


def gate_only(cfg: RunConfig, inputs: RegisterInputs, fingerprint: str, provenance: dict[str, str]) -> dict[str, Any]:
    """Without an MLflow store (tracking.enabled false, e.g. CI-size runs): the gates, nothing registered."""
    gates = evaluate_gates(GateInputs(inputs.acceptance, inputs.serving, inputs.data_contract,
                                      inputs.contract.target_revision, fingerprint, None), cfg.registry)
    skipped = {"skipped": "tracking.enabled is false: nothing registered (the gates were evaluated)",
               "model_name": cfg.registry.model_name, "version": None, "aliases": []}
    return {**skipped, **gate_record(cfg, inputs, gates, fingerprint, provenance)}


def gate_record(cfg: RunConfig, inputs: RegisterInputs, gates: list[Gate], fingerprint: str,
                provenance: dict[str, str]) -> dict[str, Any]:
    """The part of registration.json that does not depend on the registry: gates, identity, provenance.
    `failed_gates` lists every gate that withheld `champion`: failed, or not run without a waiver; `waivers` the
    reasons of the waivers that let a gate through (as the version's eaglet.waivers tag)."""
    return {
        "gates_passed": gates_passed(gates), "gates": [gate.as_json() for gate in gates],
        "failed_gates": blocking_lines(gates), "waived_gates": waived_names(gates),
        "waivers": waivers_used(gates, cfg.registry),
        "offline_accept_length": offline_accept_length(inputs.acceptance), "eval_fingerprint": fingerprint,
        "target_revision": inputs.contract.target_revision,
        "reports": {key: str(path) if path else None for key, path in inputs.report_paths.items()},
        **{key.removeprefix("eaglet."): value for key, value in provenance.items()},
    }


def say_gates(registration: dict[str, Any]) -> None:
    """Tell the person at the terminal which gates held the version back and which were waived (the stage itself
    succeeds)."""
    if registration["version"] is None:
        print(f"[register] {registration['skipped']}", flush=True)
    else:
        aliases = ", ".join(registration["aliases"]) or "none"
        print(f"[register] {registration['model_name']} v{registration['version']}: aliases {aliases}", flush=True)
    for line in registration["failed_gates"]:
        print(f"[register] gate {line}", flush=True)
    if registration.get("promotion_refused"):
        print(f"[register] not promoted: {registration['promotion_refused']}", flush=True)
    if registration["waived_gates"]:
        reasons = "; ".join(f"{family}: {reason}" for family, reason in registration["waivers"].items())
        print(f"[register] waived: {', '.join(registration['waived_gates'])} ({reasons})", flush=True)


# --- inputs ---------------------------------------------------------------------------------------------


def require(path: Path, stage: str) -> Path:
    """The path, or a FileNotFoundError naming it and the stage that writes it."""
    if not path.exists():
        raise FileNotFoundError(f"register needs {path}: run the {stage} stage first")
    return path


def optional_json(path: Path) -> Optional[dict[str, Any]]:
    return read_json(path) if path.is_file() else None


def optional_serving(path: Path) -> Optional[BenchmarkReport]:
    """The benchmark report when the stage ran (typed: a field renamed there fails here, naming it)."""
    return load_report(BenchmarkReport, path, "benchmark") if path.is_file() else None


def read_inputs(cfg: RunConfig) -> RegisterInputs:
    """Exports, target and evaluation are required; the serving and data-contract reports are gated on."""
    out = cfg.output_path
    exports = {}
    for engine in ENGINES:
        for name in EXPORT_FILES:
            require(out / "draft" / engine / name, "train")
        exports[engine] = out / "draft" / engine
    target_info = read_json(require(out / "target.json", "target"))
    acceptance_path = require(out / ACCEPTANCE_REPORT, "evaluate")
    contract = CheckpointContract.model_validate_json((exports["sglang"] / "contract.json").read_text())
    paths = {"acceptance": acceptance_path, "serving": out / SERVING_REPORT,
             "data_contract": out / DATA_CONTRACT_REPORT, "data_docs": (out / DATA_DOCS_INDEX).resolve()}
    paths = {key: path if path.is_file() else None for key, path in paths.items()}
    return RegisterInputs(exports, contract.model_copy(update={"engine": None}), target_info,
                          load_report(AcceptanceReport, acceptance_path, "evaluate"), optional_serving(out / SERVING_REPORT),
                          optional_json(out / DATA_CONTRACT_REPORT), paths)


def refuse_broken_exports(inputs: RegisterInputs, out: Path) -> None:
    """A checkpoint that fails the doctor's checks is a broken input, not a gate: nothing is registered."""
    for engine, directory in inputs.exports.items():
        failed = [check for check in inspect_checkpoint(directory, inputs.target_info) if not check.ok]
        if failed:
            listed = "\n  - ".join(f"{check.field}: {check.detail}" for check in failed)
            raise ContractMismatch(f"{directory} fails the checkpoint checks (eaglet doctor {directory} "
                                   f"--target {out / 'target'}):\n  - {listed}")


def eval_fingerprint(cfg: RunConfig, acceptance: AcceptanceReport) -> str:
    """Which prompts and decode settings the offline acceptance was measured on: versions compare only when
    this (and the target revision) is equal. The prompts count by their prompt side (`prompt_side`), never by the
    assistant text regenerate wrote: a GPU does not reproduce it, and two runs of one recipe must still compare."""
    from tasks.data.held_out import select_records

    settings = cfg.evaluation
    records = select_records(cfg.output_path / "data" / "eval.jsonl", settings.max_prompts, settings.sources)
    prompts = [prompt_side(record) for record in records]
    decoded = {"chain": acceptance.chain, "tree": acceptance.tree}
    modes = {name: mode.model_dump(include={"steps", "topk", "num_draft_tokens"})
             for name, mode in decoded.items() if mode is not None}
    measured = {"temperature": acceptance.temperature, "max_new_tokens": acceptance.max_new_tokens,
                "max_length": cfg.validation.max_length, "modes": modes}
    return hash_text(json.dumps({"prompts": prompts, "settings": measured}, sort_keys=True))


def prompt_side(record: PromptRecord) -> dict[str, Any]:
    """What defines a held-out record as a prompt: its id and source, its system and user turns, and where its
    assistant turns fall and which are supervised (each supervised one is a prompt). The assistant turns' text and
    reasoning are the target's regenerated replies, so they are left out; a pre-templated record is not regenerated,
    so its text counts whole."""
    side: dict[str, Any] = {"id": record.id, "source": record.source}
    if record.text is not None:
        return {**side, "text": record.text}
    turns = []
    for message in record.messages:
        if message.role == "assistant":
            turns.append({"role": message.role, "supervised": is_supervised(message)})
        else:
            turns.append({"role": message.role, "content": message.content})
    return {**side, "turns": turns}


def provenance_tags(cfg: RunConfig, inputs: RegisterInputs, root: Path) -> dict[str, str]:
    """Where the version came from: code (git), pinned inputs (dvc.lock), run, and the Data Docs to read."""
    changes = git_output(root, "status", "--porcelain", "--untracked-files=no")
    return {
        "eaglet.git_commit": git_commit(root),
        "eaglet.git_dirty": "unknown" if changes is None else tag_value(bool(changes)),
        "eaglet.dvc_lock_hash": dvc_lock_hash(root),
        "eaglet.run_id": cfg.run_id,
        "eaglet.data_docs": str(inputs.report_paths["data_docs"] or "none"),
    }


def git_commit(root: Path) -> str:
    """HEAD of the repository the stage runs in; "unknown" outside one."""
    return git_output(root, "rev-parse", "HEAD") or "unknown"


def git_output(root: Path, *arguments: str) -> Optional[str]:
    try:
        completed = subprocess.run(["git", *arguments], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return completed.stdout.strip() if completed.returncode == 0 else None


def dvc_lock_hash(root: Path) -> str:
    """Hash of dvc.lock's entries for every stage but this one (the inputs DVC pinned); "none" without it."""
    import yaml

    path = root / "dvc.lock"
    if not path.is_file():
        return "none"
    lock = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    upstream = {name: entry for name, entry in (lock.get("stages") or {}).items() if name != STAGE}
    return hash_text(json.dumps(upstream, sort_keys=True, default=str))


# --- MLflow ---------------------------------------------------------------------------------------------


@contextmanager
def registration_run(cfg: RunConfig) -> Iterator[Any]:
    """The pipeline's active MLflow run, or a run of our own in the config's store."""
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    import mlflow

    active = mlflow.active_run()
    if active is not None:
        yield active
        return
    from tasks.common.mlflow_store import ensure_experiment, tracking_uri

    uri = tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    ensure_experiment(uri, cfg.tracking.experiment)
    tags = {"eaglet.run_id": cfg.run_id, "eaglet.kind": "stage", "eaglet.stage": STAGE}
    with mlflow.start_run(run_name=f"{cfg.run_id}/{STAGE}", tags=tags) as own:
        yield own


def registered_contract(cfg: RunConfig, inputs: RegisterInputs, gates: list[Gate],
                        fingerprint: str) -> CheckpointContract:
    """The export's contract (engine-neutral) with the evaluation reports' headline numbers added
    (docs/architecture.md §5)."""
    acceptance = inputs.acceptance
    offline = {"mean_accept_length": offline_accept_length(acceptance),
               "greedy_equivalence": acceptance.greedy_equivalence, "prompts": acceptance.prompts,
               "records": acceptance.records, "eval_fingerprint": fingerprint}
    if acceptance.tree is not None:
        offline["tree_mean_accept_length"] = acceptance.tree.mean_accept_length
    evaluation = {**inputs.contract.evaluation, "offline": offline, "serving": serving_summary(inputs.serving),
                  "gates": {gate.name: gate.status for gate in gates}}
    return inputs.contract.model_copy(update={"evaluation": evaluation})


def serving_summary(report: Optional[BenchmarkReport]) -> dict[str, Any]:
    """Per engine: the recommended setting's acceptance as the engine measured it over the benchmark's traffic (every
    engine reports it, SGLang's gauges included), its speedup per concurrency, and the sweep ("not run" without a
    benchmark)."""
    if report is None or not report.measured:
        return {"status": "not run"}
    engines = {}
    for kind, engine in report.engines.items():
        engines[kind] = {"mean_accept_length": engine.eagle3.speculative.mean_accept_length,
                         "speedup": [row.as_json() for row in engine.speedup],
                         "recommended_num_speculative_tokens": engine.num_speculative_tokens,
                         "recommended_setting": engine.serving_setting.as_json(),
                         "sweep": [row.as_json() for row in engine.sweep]}
    return {"status": "passed" if report.passed else "failed", "engines": engines}


def recommended_serving(report: Optional[BenchmarkReport], speedup_concurrency: Optional[int], method: str) -> str:
    """Per engine, the setting the benchmark measured as fastest, with its median speedup at the level the speedup
    gate reads (`registry.speedup_concurrency`, default the lowest): the draft method, vLLM's
    `num_speculative_tokens`, SGLang's steps / topk / num_draft_tokens, and the flags that serve it."""
    if report is None or not report.measured:
        return "not measured"
    recommended = {}
    for kind, engine in report.engines.items():
        _, row = speedup_row(engine.speedup, speedup_concurrency)
        setting = engine.serving_setting
        recommended[kind] = {"method": method, "num_speculative_tokens": engine.num_speculative_tokens,
                             "steps": setting.steps,
                             "topk": setting.topk, "num_draft_tokens": setting.num_draft_tokens, "flags": setting.flags,
                             "speedup": row.output_tokens_per_s if row else None}
    return tag_value(recommended)


def tag_value(value: Any) -> str:
    """Strings as they are, everything else as JSON (MLflow tags are strings)."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def contract_tags(contract: CheckpointContract) -> dict[str, str]:
    """One `contract.<field>` tag per contract field: the full contract, searchable in the registry."""
    return {CONTRACT_TAG_PREFIX + key: tag_value(value) for key, value in contract.model_dump(mode="json").items()}


def gate_tags(cfg: RunConfig, inputs: RegisterInputs, gates: list[Gate], fingerprint: str) -> dict[str, str]:
    """The verdicts `eaglet promote` and `eaglet registry show` read back, and the waivers that let a gate through,
    with their reasons."""
    speedups = [f"{gate.name.removeprefix('speedup[').rstrip(']')}={gate.measured:.3f}"
                for gate in gates if gate.name.startswith("speedup[") and gate.measured is not None]
    accept_length = offline_accept_length(inputs.acceptance)
    return {
        TAG_GATES_PASSED: tag_value(gates_passed(gates)),
        TAG_GATES: tag_value([gate.as_json() for gate in gates]),
        TAG_FAILED_GATES: tag_value(blocking_lines(gates)),
        TAG_EVAL_FINGERPRINT: fingerprint,
        TAG_ACCEPT_LENGTH: tag_value(accept_length) if accept_length is not None else "none",
        TAG_SPEEDUP: " ".join(speedups) or "not run",
        TAG_RECOMMENDED_SERVING: recommended_serving(inputs.serving, cfg.registry.speedup_concurrency,
                                                     inputs.contract.method),
        TAG_WAIVERS: tag_value(waivers_used(gates, cfg.registry)),
    }


#: Characters MLflow refuses in a logged model's name.
FORBIDDEN_IN_MODEL_NAMES = "/:.%\"'"


def logged_model_name(method: str) -> str:
    """The logged model's name for a drafter of `method`. MLflow refuses a '.' in it, so EAGLE 3.1's
    (`eagle3.1`) is logged as `eagle3_1-drafter`; the contract and the method tag keep the method as written."""
    return "".join("_" if char in FORBIDDEN_IN_MODEL_NAMES else char for char in method) + "-drafter"


def log_drafter(client: Any, inputs: RegisterInputs, contract: CheckpointContract, active: Any) -> str:
    """A logged model holding both engine folders byte for byte, contract.json and the reports."""
    import mlflow

    model = mlflow.initialize_logged_model(
        name=logged_model_name(contract.method), source_run_id=active.info.run_id, experiment_id=active.info.experiment_id,
        model_type=f"{contract.method}-draft", tags={"eaglet.target_revision": contract.target_revision},
        params={"target_id": contract.target_id, "draft_vocab_size": str(contract.draft_vocab_size),
                "aux_layer_ids": json.dumps(contract.aux_layer_ids)},
    )
    try:
        for engine, directory in inputs.exports.items():
            client.log_model_artifacts(model.model_id, str(directory), artifact_path=engine)
        with tempfile.TemporaryDirectory(prefix="eaglet-register-") as staging:
            stage_side_files(Path(staging), inputs, contract)
            client.log_model_artifacts(model.model_id, staging)
    except BaseException:
        mlflow.finalize_logged_model(model.model_id, "FAILED")
        raise
    mlflow.finalize_logged_model(model.model_id, "READY")
    return model.model_id


def stage_side_files(staging: Path, inputs: RegisterInputs, contract: CheckpointContract) -> None:
    """contract.json and reports/{acceptance,serving,data_contract}.json beside the engine folders."""
    (staging / "contract.json").write_text(contract.model_dump_json(indent=2) + "\n", encoding="utf-8")
    reports = staging / "reports"
    reports.mkdir()
    typed = {"acceptance": inputs.acceptance, "serving": inputs.serving}
    for key, data in {**{key: report.as_json() if report else None for key, report in typed.items()},
                      "data_contract": inputs.data_contract}.items():
        if data is not None:
            write_json(reports / f"{key}.json", data)


def register_version(name: str, model_id: str, tags: dict[str, str]) -> int:
    import mlflow

    return int(mlflow.register_model(f"models:/{model_id}", name, tags=tags).version)
