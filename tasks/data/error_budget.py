"""The error budget of the validate stage: the errors of ingest, regenerate and validate over the pipeline's input.

A record that ingest could not read, or that the target could not answer, never reaches validate, so a budget over
validate's own lines would pass a run that lost most of its data upstream. The pipeline's input is what ingest took
on: its ok and error items. The items it skipped on purpose (beyond a source's `limit`, duplicates) never entered
the pipeline, and counting them would let any budget absorb every record: the embedded default reads 7,912 asset
items to keep 168.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contract.records import StageReport

UPSTREAM_REPORTS = {"ingest": "ingest_report.json", "regenerate": "regenerate_report.json"}
RULE = "(ingest error + regenerate error + validate error) / (ingest ok + ingest error)"
EXAMPLE_ERRORS = 3
REASON_CHARS = 200


def read_upstream_reports(data_dir: Path) -> dict[str, StageReport]:
    """The reports of ingest and regenerate, in pipeline order; a missing one is named, since the budget needs it."""
    reports = {}
    for stage, name in UPSTREAM_REPORTS.items():
        path = data_dir / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no {stage} report, and validate's error budget counts the errors of "
                                    f"{stage}; run the {stage} stage first")
        reports[stage] = StageReport.model_validate_json(path.read_text(encoding="utf-8"))
    return reports


def stage_counts(report: StageReport) -> dict[str, int]:
    return {"input": report.input, "ok": report.ok, "error": report.error, "skipped": report.skipped}


def error_examples(report: StageReport) -> list[str]:
    """The first EXAMPLE_ERRORS error outcomes of a stage, as 'id (or file:line): reason'."""
    errors = [outcome for outcome in report.outcomes if outcome.status == "error"][:EXAMPLE_ERRORS]
    return [f"{outcome.id or outcome.key}: {(outcome.reason or '')[:REASON_CHARS]}" for outcome in errors]


@dataclass
class ErrorBudget:
    """The reports of ingest, regenerate and validate (in that order) against validation.max_error_fraction."""

    reports: dict[str, StageReport]
    max_error_fraction: float

    @property
    def errors(self) -> int:
        return sum(report.error for report in self.reports.values())

    @property
    def pipeline_input(self) -> int:
        ingest = self.reports["ingest"]
        return ingest.ok + ingest.error

    @property
    def fraction(self) -> float:
        return self.errors / self.pipeline_input if self.pipeline_input else 0.0

    @property
    def exceeded(self) -> bool:
        return self.fraction > self.max_error_fraction

    def as_json(self) -> dict[str, Any]:
        """The budget as the data contract report shows it: per stage counts, the fraction and the cap."""
        return {
            "rule": RULE,
            "errors": self.errors,
            "pipeline_input": self.pipeline_input,
            "error_fraction": self.fraction,
            "max_error_fraction": self.max_error_fraction,
            "passed": not self.exceeded,
            "stages": {stage: stage_counts(report) for stage, report in self.reports.items()},
        }

    def violation(self, failing_expectations: list[str]) -> str:
        """Why the budget fails: the fraction, each stage's errors, and for each stage with errors its first ids and
        reasons (validate's also name the expectations that made them)."""
        per_stage = ", ".join(f"{stage} {report.error}" for stage, report in self.reports.items())
        lines = [f"error fraction {self.errors}/{self.pipeline_input} = {self.fraction:.4f} of the pipeline's input "
                 f"(ingest ok + error) exceeds validation.max_error_fraction {self.max_error_fraction} "
                 f"(errors: {per_stage})"]
        for stage, report in self.reports.items():
            if not report.error:
                continue
            cause = f" from {'; '.join(failing_expectations)}" if stage == "validate" and failing_expectations else ""
            lines.append(f"  {stage}: {report.error} error(s){cause}, e.g.")
            lines.extend(f"    {example}" for example in error_examples(report))
        return "\n".join(lines)
