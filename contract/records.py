"""Record schemas shared by every stage that reads or writes conversations, and the per-id stage report.

A prompt record holds the turns as the source gave them. An assistant turn whose `content` is None is a
slot for the target to write (MT-bench, HumanEval and chitchat only give the user side).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

Role = Literal["system", "user", "assistant"]
Status = Literal["ok", "error", "skipped"]


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(Record):
    """One turn. `supervised` marks assistant turns the drafter learns from (None: not decided yet)."""

    role: Role
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    supervised: Optional[bool] = None


class TurnGeneration(Record):
    """How one assistant turn was generated."""

    turn: int = Field(ge=0, description="index of the assistant message in `messages`")
    finish_reason: str
    completion_tokens: int = Field(ge=0)


class GenerationParams(Record):
    """Everything needed to reproduce (or distrust) a regenerated record."""

    backend: str
    model_id: str
    model_revision: str
    template_hash: Optional[str]
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    reasoning: str
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    stop_tokens: list[str]
    turns: list[TurnGeneration] = Field(default_factory=list)
    dtype: Optional[str] = Field(
        default=None, description="the dtype the target ran in (regeneration.dtype resolved); None: a server at "
        "base_url, whose dtype is its own, or a record written before it was recorded")


class Provenance(Record):
    """Where a record came from, precisely enough to find the original line again."""

    file: str
    line: int = Field(ge=1, description="1-based line (JSONL) or item number (JSON array, parquet row)")
    format: str
    original_id: Optional[str] = None


class PromptRecord(Record):
    """One normalised conversation; exactly one of `messages` (non-empty) or `text` (pre-templated)."""

    id: str
    source: str
    messages: list[Message] = Field(default_factory=list)
    text: Optional[str] = None
    split: Literal["auto", "train", "eval"] = "auto"
    provenance: Provenance
    metadata: dict[str, str] = Field(default_factory=dict)
    generation: Optional[GenerationParams] = None

    @model_validator(mode="after")
    def _messages_or_text(self) -> "PromptRecord":
        if bool(self.messages) == (self.text is not None):
            raise ValueError(f"record '{self.id}' needs exactly one of non-empty 'messages' or 'text'")
        return self


class Outcome(Record):
    """What happened to one input item: ok, or error/skipped with the reason."""

    key: str = Field(description="file:line of the input item; unique within a stage")
    id: Optional[str] = None
    status: Status
    reason: Optional[str] = None

    @model_validator(mode="after")
    def _non_ok_has_reason(self) -> "Outcome":
        if self.status != "ok" and not self.reason:
            raise ValueError(f"outcome {self.key} is '{self.status}' without a reason")
        return self


class StageReport(Record):
    """Per-id accounting of a stage: ok + error + skipped == input, always."""

    stage: str
    input: int = 0
    ok: int = 0
    error: int = 0
    skipped: int = 0
    by_source: dict[str, dict[str, int]] = Field(default_factory=dict)
    metrics: dict[str, float] = Field(default_factory=dict)
    outcomes: list[Outcome] = Field(default_factory=list)

    @classmethod
    def from_outcomes(cls, stage: str, outcomes: list[Outcome], source_of: dict[str, str]) -> "StageReport":
        """Count outcomes overall and per source (`source_of` maps an outcome key to its source)."""
        report = cls(stage=stage, outcomes=outcomes, input=len(outcomes))
        for outcome in outcomes:
            setattr(report, outcome.status, getattr(report, outcome.status) + 1)
            counts = report.by_source.setdefault(
                source_of[outcome.key], {"input": 0, "ok": 0, "error": 0, "skipped": 0}
            )
            counts["input"] += 1
            counts[outcome.status] += 1
        report.check_balanced()
        return report

    def check_balanced(self) -> None:
        """Refuse a report that lost an item: the accounting rule of docs/architecture.md §2."""
        if self.ok + self.error + self.skipped != self.input or len(self.outcomes) != self.input:
            raise ValueError(
                f"{self.stage} report does not balance: ok {self.ok} + error {self.error} + "
                f"skipped {self.skipped} != input {self.input}"
            )


def read_prompt_records(path: Path) -> Iterator[tuple[int, PromptRecord]]:
    """(line number, record) per non-blank line of a records JSONL written by a stage, so a line that is not a
    PromptRecord is a hard error naming file:line."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = PromptRecord.model_validate_json(line)
            except ValueError as error:
                raise ValueError(f"{path}:{number}: not a prompt record: {error}") from None
            yield number, record
