"""ingest stage: read every configured source into normalised prompt records, accounting for each item.

Writes `data/prompts.jsonl` (PromptRecord per line) and `data/ingest_report.json`, where every input item
is ok, error (with the reason and file:line) or skipped (with the reason), and the three add up to the input.
Sources are read in order; a repeated id, or a copy of a conversation already taken (`data.dedupe`,
tasks/data/dedupe.py), is skipped naming the first one, and does not use up the source's `limit`. The report's
`by_source` counts are after deduplication, and `metrics["duplicates.<source>"]` counts the copies per source;
a source with `drop_leading_assistant` also counts the records that lost leading assistant turns
(`metrics["leading_assistant_dropped.<source>"]`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from contract.config import DataSource, RunConfig
from contract.records import Outcome, PromptRecord, Provenance, StageReport
from tasks.common.artifacts import write_json, write_jsonl
from tasks.common.progress import advance, progress_bar
from tasks.data.dedupe import conversation_key
from tasks.data.formats import BadRecord, Normalised, normalise
from tasks.data.input_files import iter_items
from tasks.data.sources import source_file

@dataclass
class IngestResult:
    prompts_path: Path
    report_path: Path
    report: StageReport

    def summary(self) -> dict[str, float]:
        """Numbers worth tracking (MLflow metrics)."""
        return {"input": self.report.input, "ok": self.report.ok, "error": self.report.error,
                "skipped": self.report.skipped}

    def reports(self) -> list[Path]:
        """Small files worth attaching to the tracking run."""
        return [self.report_path]


def run(cfg: RunConfig) -> IngestResult:
    """Ingest cfg.data.sources into `<output_dir>/data/`."""
    if not cfg.data.sources:
        raise ValueError("data.sources is empty: configure at least one file or embedded asset to ingest")
    records: list[PromptRecord] = []
    outcomes: list[Outcome] = []
    source_of: dict[str, str] = {}
    seen = Seen(cfg.data.dedupe)
    for source in cfg.data.sources:
        for record, outcome in ingest_source(source, seen):
            outcomes.append(outcome)
            source_of[outcome.key] = source.name
            if record is not None:
                records.append(record)
    report = StageReport.from_outcomes("ingest", outcomes, source_of)
    for source in cfg.data.sources:
        report.metrics[f"duplicates.{source.name}"] = float(seen.copies.get(source.name, 0))
        if source.drop_leading_assistant:
            report.metrics[f"leading_assistant_dropped.{source.name}"] = float(seen.leading_dropped.get(source.name, 0))
    data_dir = cfg.output_path / "data"
    prompts_path = data_dir / "prompts.jsonl"
    report_path = data_dir / "ingest_report.json"
    write_jsonl(prompts_path, records)
    write_json(report_path, report)
    return IngestResult(prompts_path, report_path, report)


@dataclass
class Seen:
    """What earlier items (of every source) took: ids and conversation keys, each with the first holder."""

    dedupe: str
    ids: dict[str, str] = field(default_factory=dict)
    conversations: dict[str, str] = field(default_factory=dict)
    copies: dict[str, int] = field(default_factory=dict)
    leading_dropped: dict[str, int] = field(default_factory=dict)

    def copy_of(self, source: str, key: str | None) -> str | None:
        """The id of the record this conversation copies, counting the copy; None when it is new."""
        if key is None or key not in self.conversations:
            return None
        self.copies[source] = self.copies.get(source, 0) + 1
        return self.conversations[key]


def ingest_source(source: DataSource, seen: Seen):
    """Yield (record or None, outcome) for every item of one source; `seen` tracks ids and conversations
    across sources."""
    path, fmt, portable = source_file(source)
    accepted = 0
    items = list(iter_items(path))
    with progress_bar(f"ingest {source.name}", len(items)) as bar:
        for position, item in enumerate(items):
            key = f"{source.name}/{portable}:{item.line}"
            advance(bar)
            if position < source.skip:
                yield None, Outcome(key=key, status="skipped", reason=f"before data.sources '{source.name}' skip {source.skip}")
                continue
            if (position - source.skip) % source.every:
                yield None, Outcome(key=key, status="skipped",
                                    reason=f"between data.sources '{source.name}' every {source.every}")
                continue
            if item.error is not None:
                yield None, Outcome(key=key, status="error", reason=item.error)
                continue
            if source.limit is not None and accepted >= source.limit:
                yield None, Outcome(key=key, status="skipped", reason=f"beyond data.sources '{source.name}' limit {source.limit}")
                continue
            try:
                normalised = normalise(item.data, fmt, item.key)
            except BadRecord as error:
                yield None, Outcome(key=key, status="error", reason=f"{portable} item {item.line}: {error}")
                continue
            record_id = f"{source.name}:{normalised.original_id or content_id(item.data)}"
            if record_id in seen.ids:
                yield None, Outcome(key=key, id=record_id, status="skipped",
                                    reason=f"duplicate id {record_id} (first at {seen.ids[record_id]})")
                continue
            if source.drop_leading_assistant:
                drop_leading_assistant(normalised)
            if source.max_user_turns is not None:
                keep_user_turns(normalised, source.max_user_turns)
            conversation = conversation_key(normalised, seen.dedupe)
            original = seen.copy_of(source.name, conversation)
            if original is not None:
                yield None, Outcome(key=key, id=record_id, status="skipped",
                                    reason=f"copy of {original} (data.dedupe={seen.dedupe}: same "
                                           f"{'first user turn' if seen.dedupe == 'first_prompt' else 'user turns'})")
                continue
            seen.ids[record_id] = key
            if conversation is not None:
                seen.conversations[conversation] = record_id
            split = source.split if source.split != "auto" else normalised.split
            record = PromptRecord(
                id=record_id,
                source=source.name,
                messages=normalised.messages,
                text=normalised.text,
                split=split,
                provenance=Provenance(file=portable, line=item.line, format=normalised.format, original_id=normalised.original_id),
                metadata=normalised.metadata,
            )
            accepted += 1
            if "dropped_leading_turns" in normalised.metadata:
                seen.leading_dropped[source.name] = seen.leading_dropped.get(source.name, 0) + 1
            yield record, Outcome(key=key, id=record_id, status="ok")


def drop_leading_assistant(normalised: Normalised) -> None:
    """Remove the assistant turns before the first user turn (system turns stay), recording how many went.
    A conversation without a user turn is left whole for validate to reject."""
    first_user = next((index for index, message in enumerate(normalised.messages) if message.role == "user"), None)
    if first_user is None:
        return
    kept = [message for index, message in enumerate(normalised.messages)
            if index >= first_user or message.role != "assistant"]
    if len(kept) < len(normalised.messages):
        normalised.metadata["dropped_leading_turns"] = str(len(normalised.messages) - len(kept))
        normalised.messages = kept


def keep_user_turns(normalised: Normalised, limit: int) -> None:
    """Cut a conversation after its `limit`-th user turn and its answer; record how many turns went."""
    user_seen = 0
    for index, message in enumerate(normalised.messages):
        if message.role == "user":
            user_seen += 1
            if user_seen > limit:
                dropped = len(normalised.messages) - index
                normalised.messages = normalised.messages[:index]
                normalised.metadata["dropped_turns"] = str(dropped)
                return


def content_id(data: object) -> str:
    """A stable id for an item that has none: the hash of its canonical JSON."""
    canonical = json.dumps(data, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha1(canonical.encode("utf-8")).hexdigest()[:12]
