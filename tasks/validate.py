"""validate stage: the data contract of the regenerated records, enforced with Great Expectations.

Reads `data/regenerated.jsonl`, the materialised `target/` (tokenizer + chat template), `target.json` and the
reports of ingest and regenerate (`data/ingest_report.json`, `data/regenerate_report.json`: the error budget).
Each input line becomes one row of derived columns (expectations/record_checks.py) that the suite
`expectations/regenerated_records.json` checks with real GX validations; a row failing an expectation
whose `meta.on_failure` is `error` is an error outcome, one failing only `skipped` ones is skipped, both
with a reason naming the expectation. The records that pass are split train/eval (tasks/data/split.py),
and the split is checked by `expectations/train_eval_split.json` (no conversation or normalised prompt in
both splits, eval requests honoured) and `expectations/decontamination.json` (held-out prompts whose word n-grams
the training records already contain: tasks/data/contamination.py).

Writes `data/train.jsonl`, `data/eval.jsonl`, `reports/data_docs/` (GX Data Docs that load nothing from the
network: tasks/data/offline_docs.py), `reports/data_contract.json`
(per expectation: passed, unexpected count, sample ids; totals) and `data/validate_report.json` (one outcome
per input line: ok + error + skipped == input). The error budget counts the errors of ingest, regenerate and
validate over the pipeline's input (tasks/data/error_budget.py). When that fraction exceeds
`validation.max_error_fraction`, an expectation exceeds its `validation.expectation_thresholds` entry, a `fail`
expectation fails, or the train split keeps fewer than `validation.min_train_records` records or
`validation.min_supervised_tokens` supervised tokens after truncation, it raises DataContractError after writing
the reports (and no train/eval files).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from contract.config import RunConfig
from contract.records import Outcome, StageReport
from expectations.record_checks import CheckSettings, DerivedRecord, derive
from tasks.common.artifacts import atomic_directory, write_json, write_jsonl
from tasks.common.target_info import load_tokenizer, read_target_info
from tasks.data import split as data_split
from tasks.data.contamination import PromptOverlap, contamination_summary, prompt_overlaps
from tasks.data.error_budget import ErrorBudget, read_upstream_reports
from tasks.data.offline_docs import make_offline

EXPECTATIONS_DIR = Path(__file__).resolve().parent.parent / "expectations"
RECORD_SUITE = "regenerated_records"
SPLIT_SUITE = "train_eval_split"
DECONTAMINATION_SUITE = "decontamination"
INPUT_NAME = "regenerated.jsonl"
SAMPLE_IDS = 10
EXAMPLE_IDS = 5
#: The cut_turns_allowed expectation's cap when cut turns are kept (no_end, as_finished): no record reaches it.
ANY_NUMBER_OF_TURNS = 1_000_000


class DataContractError(RuntimeError):
    """The regenerated data breaks its contract; the message names each failing expectation and example ids."""

    def __init__(self, violations: list[str], contract_path: Path, data_docs_index: Path) -> None:
        super().__init__("data contract failed:\n- " + "\n- ".join(violations)
                         + f"\n(reports: {contract_path}, {data_docs_index})")
        self.violations = violations
        self.contract_path = contract_path


@dataclass
class ExpectationOutcome:
    """One expectation's verdict, as the data contract reports it."""

    name: str
    suite: str
    expectation_type: str
    column: Optional[str]
    on_failure: str
    description: str
    passed: bool
    unexpected_count: int
    evaluated: int
    not_applicable: int
    failing_rows: list[int] = field(default_factory=list)
    sample_ids: list[str] = field(default_factory=list)
    sample_keys: list[str] = field(default_factory=list)
    note: Optional[str] = None
    observed_value: Any = None
    exception: Optional[str] = None

    def as_json(self, input_count: int) -> dict[str, Any]:
        entry = {
            "name": self.name,
            "suite": self.suite,
            "expectation_type": self.expectation_type,
            "column": self.column,
            "on_failure": self.on_failure,
            "description": self.description,
            "passed": self.passed,
            "unexpected_count": self.unexpected_count,
            "unexpected_fraction_of_input": self.unexpected_count / input_count if input_count else 0.0,
            "evaluated": self.evaluated,
            "not_applicable": self.not_applicable,
            "sample_ids": self.sample_ids,
            "sample_keys": self.sample_keys,
        }
        for name in ("note", "observed_value", "exception"):
            if getattr(self, name) is not None:
                entry[name] = getattr(self, name)
        return entry


@dataclass
class ValidateResult:
    train_path: Path
    eval_path: Path
    contract_path: Path
    report_path: Path
    data_docs_dir: Path
    report: StageReport
    train: int
    eval: int
    supervised_tokens: int

    def summary(self) -> dict[str, float]:
        """Numbers worth tracking (MLflow metrics)."""
        return {"input": self.report.input, "ok": self.report.ok, "error": self.report.error,
                "skipped": self.report.skipped, "train": self.train, "eval": self.eval,
                "supervised_tokens": self.supervised_tokens}

    def reports(self) -> list[Path]:
        """Small files worth attaching to the tracking run (the Data Docs site stays on disk)."""
        return [self.contract_path, self.report_path]


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSONL text, split on "\n" only: JSON leaves U+2028, U+2029 and U+0085 unescaped inside
    strings (ShareGPT has them), and str.splitlines() would cut a record there."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def run(cfg: RunConfig) -> ValidateResult:
    """Validate `<output_dir>/data/regenerated.jsonl` and split it into train/eval."""
    out = cfg.output_path
    data_dir, reports_dir = out / "data", out / "reports"
    source = data_dir / INPUT_NAME
    suites = {name: load_suite_json(name) for name in (RECORD_SUITE, SPLIT_SUITE, DECONTAMINATION_SUITE)}
    check_threshold_names(cfg, suites[RECORD_SUITE])
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no regenerated records; run the regenerate stage first")
    upstream = read_upstream_reports(data_dir)
    target_info = read_target_info(out)
    tokenizer = load_tokenizer(out / "target", cfg.model)

    lines = jsonl_lines(source.read_text(encoding="utf-8"))
    settings = CheckSettings(cfg.validation.max_length, cfg.regeneration.reasoning, target_info.chat_template_hash,
                             cfg.validation.cut_turns)
    rows = derive(lines, tokenizer, settings, INPUT_NAME)
    explain_repeated_ids(rows)
    parameters = {
        "reasoning_content_allowed": [False, True] if cfg.regeneration.reasoning == "save" else [False],
        "target_chat_template_hashes": [settings.chat_template_hash or "<target has no chat template>"],
        "max_cut_turns": 0 if cfg.validation.cut_turns == "drop" else ANY_NUMBER_OF_TURNS,
    }

    docs_dir = reports_dir / "data_docs"
    with atomic_directory(docs_dir) as staging:
        context = gx_context(staging)
        record_checks = run_suite(context, suites[RECORD_SUITE], record_frame(rows), parameters, cfg.run_id,
                                  [row.label for row in rows])
        outcomes, ok_rows = decide_outcomes(rows, record_checks)
        candidates = [data_split.candidate(row.record, cfg.validation.conversation_id_pattern, row.first_prompt)
                      for row in ok_rows]
        splits = data_split.assign_splits(candidates, cfg.validation.eval_fraction, cfg.validation.seed)
        split_checks = run_suite(context, suites[SPLIT_SUITE], split_frame(candidates, splits, [row.key for row in ok_rows]),
                                 {}, cfg.run_id, [item.id for item in candidates])
        overlaps = held_out_overlaps(cfg, ok_rows, splits)
        split_checks += run_suite(context, decontamination_suite(cfg, suites[DECONTAMINATION_SUITE]),
                                  overlap_frame(overlaps), {"max_prompt_overlap": cfg.validation.max_prompt_overlap},
                                  cfg.run_id, [overlap.id for overlap in overlaps])
        if not (staging / "index.html").is_file():
            raise RuntimeError(f"GX Data Docs did not write index.html under {staging}")
        make_offline(staging)  # local copies of the CDN assets: the site works on an air-gapped cluster

    source_of = {row.key: row.record.source if row.record is not None else "unparsed" for row in rows}
    report = StageReport.from_outcomes("validate", outcomes, source_of)
    report.metrics.update(cut_turn_counts(rows))
    report.metrics.update(turn_expansion_counts(rows))
    budget = ErrorBudget({**upstream, "validate": report}, cfg.validation.max_error_fraction)
    checks = record_checks + split_checks
    supervised = {"train": 0, "eval": 0}
    for row, split in zip(ok_rows, splits):
        supervised[split] += int(row.columns["supervised_tokens"] or 0)
    violations = (contract_violations(cfg, budget, checks)
                  + train_size_violations(cfg, report, splits.count("train"), supervised["train"]))

    contract_path = reports_dir / "data_contract.json"
    report_path = data_dir / "validate_report.json"
    write_json(contract_path, {
        "passed": not violations,
        "violations": violations,
        "suites": {name: suite["name"] for name, suite in suites.items()},
        "expectations": [check.as_json(report.input) for check in checks],
        "totals": {
            "input": report.input, "ok": report.ok, "error": report.error, "skipped": report.skipped,
            "train": splits.count("train"), "eval": splits.count("eval"),
            "supervised_tokens": {**supervised, "total": supervised["train"] + supervised["eval"]},
        },
        "error_budget": budget.as_json(),
        "decontamination": contamination_summary(overlaps, cfg.validation.max_prompt_overlap,
                                                 cfg.validation.decontamination_ngram),
        "thresholds": {"max_error_fraction": cfg.validation.max_error_fraction,
                       "error_fraction": budget.fraction,
                       "min_train_records": cfg.validation.min_train_records,
                       "min_supervised_tokens": cfg.validation.min_supervised_tokens,
                       "expectation_thresholds": dict(cfg.validation.expectation_thresholds)},
        "settings": {"max_length": cfg.validation.max_length, "eval_fraction": cfg.validation.eval_fraction,
                     "seed": cfg.validation.seed, "reasoning": cfg.regeneration.reasoning,
                     "conversation_id_pattern": cfg.validation.conversation_id_pattern,
                     "cut_turns": cfg.validation.cut_turns,
                     "chat_template_hash": settings.chat_template_hash},
    })
    write_json(report_path, report)

    train_path, eval_path = data_dir / "train.jsonl", data_dir / "eval.jsonl"
    if violations:
        # Never leave an older run's train/eval beside a failed contract for a later stage to pick up.
        train_path.unlink(missing_ok=True)
        eval_path.unlink(missing_ok=True)
        raise DataContractError(violations, contract_path, docs_dir / "index.html")
    records = [row.record for row in ok_rows]
    write_jsonl(train_path, [record for record, split in zip(records, splits) if split == "train"])
    write_jsonl(eval_path, [record for record, split in zip(records, splits) if split == "eval"])
    return ValidateResult(train_path, eval_path, contract_path, report_path, docs_dir, report,
                          splits.count("train"), splits.count("eval"), supervised["train"] + supervised["eval"])


def cut_turn_counts(rows: list[DerivedRecord]) -> dict[str, float]:
    """Assistant turns regeneration stopped at max_new_tokens, and the records holding them (all input lines)."""
    per_record = [int(row.columns.get("cut_turns") or 0) for row in rows]
    return {"cut_turns": float(sum(per_record)), "records_with_cut_turns": float(sum(1 for count in per_record if count))}


def turn_expansion_counts(rows: list[DerivedRecord]) -> dict[str, float]:
    """Multi-turn reasoning records that train as one sample per turn (contract/chat_rendering.py), and those samples."""
    per_record = [int(row.columns.get("turn_samples") or 0) for row in rows]
    return {"records_expanded_per_turn": float(sum(1 for count in per_record if count)),
            "turn_samples": float(sum(per_record))}


# --- inputs -------------------------------------------------------------------------------------------------

def load_suite_json(name: str) -> dict[str, Any]:
    return json.loads((EXPECTATIONS_DIR / f"{name}.json").read_text(encoding="utf-8"))


def expectation_names(suite: dict[str, Any]) -> list[str]:
    return [expectation["meta"]["name"] for expectation in suite["expectations"]]


def check_threshold_names(cfg: RunConfig, record_suite: dict[str, Any]) -> None:
    known = expectation_names(record_suite)
    unknown = sorted(set(cfg.validation.expectation_thresholds) - set(known))
    if unknown:
        raise ValueError(f"validation.expectation_thresholds names unknown expectation(s) {', '.join(unknown)}; "
                         f"known: {', '.join(known)}")


def explain_repeated_ids(rows: list[DerivedRecord]) -> None:
    """Say, beside each repeated id, where else it occurs (GX's unique_ids decides; this is the reason text)."""
    lines: dict[str, list[int]] = {}
    for row in rows:
        if row.record is not None:
            lines.setdefault(row.record.id, []).append(row.line)
    for row in rows:
        if row.record is not None and len(lines[row.record.id]) > 1:
            others = [line for line in lines[row.record.id] if line != row.line]
            row.details["id"] = f"id '{row.record.id}' is also on line(s) {others}"


# --- frames -------------------------------------------------------------------------------------------------

def record_frame(rows: list[DerivedRecord]):
    import pandas as pd

    from expectations.record_checks import COLUMNS

    return pd.DataFrame([row.columns for row in rows], columns=list(COLUMNS), dtype=object)


def split_frame(candidates: list[data_split.SplitCandidate], splits: list[str], keys: list[str]):
    """One row per split record (`key`: its input line) with, for its conversation and prompt, the number of
    splits they occur in."""
    import pandas as pd

    spread = data_split.crossing_keys(candidates, splits)
    rows = []
    for item, split, line_key in zip(candidates, splits, keys):
        item_keys = item.keys()
        rows.append({
            "key": line_key,
            "id": item.id,
            "split": split,
            "requested_split": item.requested,
            "conversation": item.conversation,
            "prompt": item.prompt or None,
            "conversation_splits": len(spread[item_keys[0]]),
            "prompt_splits": len(spread[item_keys[1]]) if len(item_keys) > 1 else None,
            "eval_request_honoured": item.requested != "eval" or split == "eval",
        })
    columns = ["key", "id", "split", "requested_split", "conversation", "prompt", "conversation_splits", "prompt_splits",
               "eval_request_honoured"]
    return pd.DataFrame(rows, columns=columns, dtype=object)


def held_out_overlaps(cfg: RunConfig, ok_rows: list[DerivedRecord], splits: list[str]) -> list[PromptOverlap]:
    """Each held-out user turn's n-gram overlap with the train split."""
    train = [row.record for row, split in zip(ok_rows, splits) if split == "train"]
    held_out = [row.record for row, split in zip(ok_rows, splits) if split == "eval"]
    return prompt_overlaps(held_out, train, cfg.validation.decontamination_ngram)


def overlap_frame(overlaps: list[PromptOverlap]):
    """One row per held-out prompt checked (`key`: record id and user turn)."""
    import pandas as pd

    columns = ["key", "id", "turn", "source", "ngrams", "ngram_overlap"]
    rows = [{"key": f"{overlap.id}#turn{overlap.turn}", "id": overlap.id, "turn": overlap.turn,
             "source": overlap.source, "ngrams": overlap.ngrams, "ngram_overlap": overlap.overlap}
            for overlap in overlaps]
    return pd.DataFrame(rows, columns=columns).astype({"ngram_overlap": float})


def decontamination_suite(cfg: RunConfig, suite: dict[str, Any]) -> dict[str, Any]:
    """The suite with its one expectation's `mostly` set from validation.max_contaminated_share (GX takes no
    parameter there)."""
    configured = json.loads(json.dumps(suite))
    for expectation in configured["expectations"]:
        expectation["kwargs"]["mostly"] = 1.0 - cfg.validation.max_contaminated_share
    return configured


# --- GX -----------------------------------------------------------------------------------------------------

def gx_context(docs_dir: Path) -> Any:
    """An ephemeral GX context whose only Data Docs site is written under `docs_dir`."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    for site in list(context.list_data_docs_sites()):
        context.delete_data_docs_site(site)
    context.add_data_docs_site(site_name="eaglet", site_config={
        "class_name": "SiteBuilder",
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir.resolve())},
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
    })
    return context


def run_suite(context: Any, suite_json: dict[str, Any], frame: Any, parameters: dict[str, Any], run_name: str,
              labels: list[str]) -> list[ExpectationOutcome]:
    """Validate `frame` (one row per input line, named by its `key` column) against a suite through a
    checkpoint that updates the Data Docs; one verdict per expectation, with its failing row positions and
    (up to SAMPLE_IDS) the labels and keys of those rows."""
    import great_expectations as gx
    from great_expectations.checkpoint import UpdateDataDocsAction
    from great_expectations.core.run_identifier import RunIdentifier

    import expectations.custom_expectations  # noqa: F401  registers the custom types before the suite loads

    suite = context.suites.add(gx.ExpectationSuite(**json.loads(json.dumps(suite_json))))
    if len(suite.expectations) != len(suite_json["expectations"]):
        loaded = {expectation.meta.get("name") for expectation in suite.expectations}
        dropped = [name for name in expectation_names(suite_json) if name not in loaded]
        raise RuntimeError(f"GX dropped expectation(s) {dropped} of suite {suite_json['name']} while loading it")
    name = suite_json["name"]
    batch = context.data_sources.add_pandas(name).add_dataframe_asset(name).add_batch_definition_whole_dataframe("all")
    definition = context.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch, suite=suite))
    checkpoint = context.checkpoints.add(gx.Checkpoint(
        name=f"{name}_checkpoint",
        validation_definitions=[definition],
        actions=[UpdateDataDocsAction(name="data_docs")],
        result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["key"]},
    ))
    result = checkpoint.run(batch_parameters={"dataframe": frame}, expectation_parameters=parameters,
                            run_id=RunIdentifier(run_name=run_name))
    (validation,) = result.run_results.values()
    return [expectation_outcome(item, name, frame, labels) for item in validation.results]


def expectation_outcome(item: Any, suite: str, frame: Any, labels: list[str]) -> ExpectationOutcome:
    config = item.expectation_config
    meta = config.meta or {}
    column = config.kwargs.get("column")
    details = item.result or {}
    keys = list(frame["key"])
    position = {key: index for index, key in enumerate(keys)}
    failing = sorted({position[entry["key"]] for entry in details.get("unexpected_index_list") or []})
    info = item.exception_info or {}
    raised = [info] if "raised_exception" in info else [value for value in info.values() if isinstance(value, dict)]
    exception = next((entry.get("exception_message") for entry in raised if entry.get("raised_exception")), None)
    not_applicable = int(frame[column].isna().sum()) if column in frame else 0
    if "parsed" in frame and column not in (None, "parsed"):
        not_applicable -= int((frame["parsed"] == False).sum())  # noqa: E712  unparsed lines are not 'not applicable'
    return ExpectationOutcome(
        name=meta.get("name", config.type),
        suite=suite,
        expectation_type=config.type,
        column=column,
        on_failure=meta.get("on_failure", "fail"),
        description=meta.get("description", ""),
        passed=bool(item.success),
        unexpected_count=int(details.get("unexpected_count") or len(failing)),
        evaluated=int(details.get("element_count") or len(frame)) - int(details.get("missing_count") or 0),
        not_applicable=max(not_applicable, 0),
        failing_rows=failing,
        sample_ids=list(dict.fromkeys(labels[row] for row in failing))[:SAMPLE_IDS],
        sample_keys=[keys[row] for row in failing[:SAMPLE_IDS]],
        note=meta.get("note"),
        observed_value=details.get("observed_value"),
        exception=exception,
    )


# --- decisions ----------------------------------------------------------------------------------------------

def decide_outcomes(rows: list[DerivedRecord], checks: list[ExpectationOutcome]) -> tuple[list[Outcome], list[DerivedRecord]]:
    """One outcome per row from the failing expectations; the rows that pass everything."""
    failed: dict[int, list[ExpectationOutcome]] = {}
    for check in checks:
        for row in check.failing_rows:
            failed.setdefault(row, []).append(check)
    outcomes, ok_rows = [], []
    for index, row in enumerate(rows):
        checks_failed = failed.get(index, [])
        record_id = row.record.id if row.record is not None else None
        if not checks_failed:
            outcomes.append(Outcome(key=row.key, id=record_id, status="ok"))
            ok_rows.append(row)
            continue
        errors = [check for check in checks_failed if check.on_failure != "skipped"]
        status = "error" if errors else "skipped"
        reason = "; ".join(f"{check.name}: {row.details.get(check.column or '', 'failed')}"
                           for check in (errors or checks_failed))
        outcomes.append(Outcome(key=row.key, id=record_id, status=status, reason=reason))
    return outcomes, ok_rows


def contract_violations(cfg: RunConfig, budget: ErrorBudget, checks: list[ExpectationOutcome]) -> list[str]:
    """Why the records break the contract (empty when they keep it): the error budget and the expectations."""
    violations = []
    report = budget.reports["validate"]

    def described(check: ExpectationOutcome) -> str:
        examples = ", ".join(check.sample_ids[:EXAMPLE_IDS])
        return f"{check.name} ({check.unexpected_count} failing, e.g. {examples})" if examples else check.name

    if budget.exceeded:
        violations.append(budget.violation([described(check) for check in checks
                                            if check.on_failure == "error" and not check.passed]))
    for check in checks:
        cap = cfg.validation.expectation_thresholds.get(check.name)
        fraction = check.unexpected_count / report.input if report.input else 0.0
        if cap is not None and fraction > cap:
            violations.append(f"{described(check)}: fraction {fraction:.4f} exceeds validation.expectation_thresholds "
                              f"{check.name} = {cap}")
        if check.exception is not None:
            violations.append(f"{check.name}: the expectation raised {check.exception}")
        elif check.on_failure == "fail" and not check.passed:
            observed = f" (observed {check.observed_value})" if check.observed_value is not None else ""
            violations.append(f"{described(check)}{observed}")
    return violations


def train_size_violations(cfg: RunConfig, report: StageReport, train_records: int, train_tokens: int) -> list[str]:
    """A train split too small to learn from fails the stage, whatever emptied it: skipped records are no errors,
    so a `max_length` shorter than every prompt would otherwise pass with nothing left."""
    settings = cfg.validation
    context = (f"after truncation to validation.max_length {settings.max_length}; of {report.input} input line(s), "
               f"{report.skipped} skipped and {report.error} error(s)")
    violations = []
    if train_records < settings.min_train_records:
        violations.append(f"validation.min_train_records: the train split has {train_records} record(s), fewer than "
                          f"{settings.min_train_records} ({context})")
    if train_tokens < settings.min_supervised_tokens:
        violations.append(f"validation.min_supervised_tokens: the train split has {train_tokens} supervised token(s), "
                          f"fewer than {settings.min_supervised_tokens} ({context})")
    return violations
