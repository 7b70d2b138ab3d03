"""regenerate stage: the target rewrites every assistant turn, so the drafter learns the target's own text.

User and system turns are kept; each assistant turn is one generation event whose history holds the
turns before it, earlier assistant turns being the regenerated ones (without reasoning).

Two schedules, one result. Through a server (backend openai) records stream: `concurrency` records per endpoint
are in flight (`regeneration.base_url` may list replicas: tasks/data/endpoints.py spreads the requests and fails
over) and each sends its next turn the moment its previous one returns, so the engine's batch stays full
instead of draining at the end of every round (a round waits for its longest answer). The local backend
batches in-process, so it goes by chunks: turn k of every record of a chunk together, then turn k+1.
Finished records are committed to a journal every `chunk_records`, so a killed run resumes without loss
or duplicates; a server is first checked to serve the run's target, and a journal another server wrote is
started over (tasks/data/served_model.py).

A record whose first prompt is already over `validation.max_length` is not sent: validate would drop it whatever
the target answers (tasks/data/length_gate.py); it ends `skipped`, its length in the reason.

A server that refuses a request (a 4xx not worth retrying) costs that record an error. One that refuses
REFUSAL_STREAK finished requests in a row refuses everything (wrong model name, credentials or endpoint), so
the stage stops with ServerRefusedError carrying the URL and the first refusal instead of marking every
record an error; what finished is kept in the journal, except the refused records, which a rerun sends again.

Writes `data/regenerated.jsonl` (records with their generation parameters) and
`data/regenerate_report.json` (every input id: ok, error + reason, or skipped + reason; tokens/s).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from contract.chat_rendering import served_history
from contract.config import RunConfig
from contract.reasoning import ReasoningError, split_reasoning
from contract.records import (GenerationParams, Message, Outcome, PromptRecord, StageReport, TurnGeneration,
                              read_prompt_records)
from contract.secrets import redacted_url, unredacted_mapping
from tasks.common.artifacts import read_json, write_json, write_jsonl
from tasks.data.generation import GenerationReply, GenerationRequest, Generator
from tasks.data.journal import Journal
from tasks.data.length_gate import over_length_reason, prompt_tokens
from tasks.data.reply_settings import reply_settings
from tasks.common.progress import advance, progress_bar


REFUSAL_STREAK = 8  # finished requests refused in a row that stop the stage (any other reply ends a streak)


class PlanError(ValueError):
    """A record whose turns cannot be regenerated; the message is its error reason."""


class ServerRefusedError(RuntimeError):
    """The server refused REFUSAL_STREAK requests in a row: every request is wrong, not one record."""


@dataclass
class RefusalWatch:
    """The current streak of refused requests (in the order they finish) and the records in it.

    Any other reply ends a streak shorter than REFUSAL_STREAK; once one reaches it, `stopped` stays set. The
    records of the current streak are held back from the journal: an occasional refusal is committed as that
    record's error once its streak ends, but after a stop a rerun must send them again.
    """

    url: str
    in_a_row: int = 0
    first_refusal: Optional[str] = None
    held_keys: set[str] = field(default_factory=set)
    stopped: bool = False

    def observe(self, key: str, reply: GenerationReply) -> None:
        if reply.refused:
            if self.in_a_row == 0:
                self.first_refusal = reply.error
            self.in_a_row += 1
            self.held_keys.add(key)
            self.stopped = self.stopped or self.in_a_row >= REFUSAL_STREAK
        elif not self.stopped:
            self.in_a_row = 0
            self.first_refusal = None
            self.held_keys.clear()

    def error(self) -> ServerRefusedError:
        return ServerRefusedError(
            f"regeneration stopped: {self.url} refused {self.in_a_row} requests in a row (REFUSAL_STREAK = "
            f"{REFUSAL_STREAK}), so it refuses every request; the first refusal: {self.first_refusal}. Records "
            f"finished before are kept in the journal; fix the model name, credentials, endpoint or server and rerun "
            f"to resume.")


@dataclass
class RegenerateResult:
    output_path: Path
    report_path: Path
    report: StageReport

    def summary(self) -> dict[str, float]:
        counts = {"input": self.report.input, "ok": self.report.ok, "error": self.report.error, "skipped": self.report.skipped}
        return {**counts, **self.report.metrics}

    def reports(self) -> list[Path]:
        return [self.report_path]


@dataclass
class PendingRecord:
    """A record on its way through the rounds of a chunk."""

    key: str
    record: PromptRecord
    messages: list[Message]
    turns: list[TurnGeneration] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def slots(self) -> list[int]:
        return [index for index, message in enumerate(self.messages) if message.role == "assistant"]


def run(cfg: RunConfig) -> RegenerateResult:
    """Regenerate `data/prompts.jsonl` into `data/regenerated.jsonl`, resuming a journal if one exists."""
    data_dir = cfg.output_path / "data"
    target_info = read_json(cfg.output_path / "target.json")
    records = read_prompts(data_dir / "prompts.jsonl")
    records_by_key = dict(records)
    params = generation_params(cfg, target_info)
    journal = Journal(data_dir / "regenerate.journal.jsonl", settings_fingerprint(params, cfg))
    done = {key: entry for key, entry in journal.load().items() if entry.get("input") == input_hash(records_by_key.get(key))}
    todo = [(key, record) for key, record in records if key not in done]
    stats = {"completion_tokens": 0.0, "generation_seconds": 0.0, "records": 0.0, "records_over_max_length": 0.0}
    if todo:
        with ExitStack() as stack:
            generator = open_generator(cfg, stack, target_info) if cfg.regeneration.enabled else None
            if generator is not None:
                if not journal_of_this_server(journal, generator, done):
                    journal.start()
                    done, todo = {}, list(records)
                over_length, todo = gate_over_length(cfg, todo)
                journal.commit(over_length)
                done.update((entry["key"], entry) for entry in over_length)
                stats["records_over_max_length"] = float(len(over_length))
            with progress_bar("regenerate", len(todo)) as bar:

                def commit(entries: list[dict[str, Any]]) -> None:
                    journal.commit(entries)
                    done.update((entry["key"], entry) for entry in entries)
                    advance(bar, len(entries))

                if generator is not None and generator.streams_records:
                    stream_records(todo, generator, cfg, params, stats, commit)
                else:
                    for chunk in chunks(todo, cfg.regeneration.chunk_records):
                        commit(regenerate_chunk(chunk, generator, cfg, params, stats))
    return finish(cfg, records, done, stats, journal)


def journal_of_this_server(journal: Journal, generator: Generator, done: dict[str, dict[str, Any]]) -> bool:
    """Whether the journal's entries may be extended by `generator`: they were written by a server serving the same
    model (tasks/data/served_model.py), or there are none. A server's identity is noted before its first entry, so
    a journal another model's server wrote (behind the same URL, even under the same name) is started over."""
    identity = getattr(generator, "identity", None)  # None: the local backend, which no server line names
    if done and journal.server != identity:
        print(f"[regenerate] the journal was written by another server ({journal.server}), not {identity}: "
              "starting over", flush=True)
        return False
    if identity is not None and journal.server != identity:
        journal.note_server(identity)
    return True


def read_prompts(path: Path) -> list[tuple[str, PromptRecord]]:
    """(outcome key, record) per line of prompts.jsonl; ingest wrote it, so a bad line is a hard error."""
    return [(f"prompts.jsonl:{number}", record) for number, record in read_prompt_records(path)]


def generation_params(cfg: RunConfig, target_info: dict[str, Any]) -> GenerationParams:
    settings = cfg.regeneration
    backend = settings.backend if settings.enabled else "source"
    # written into every record: the endpoints without their credentials, or the engine the stage starts
    server = ",".join(redacted_url(url) for url in settings.endpoints) if settings.base_url else settings.engine
    return GenerationParams(
        backend=backend if backend != "openai" else f"openai:{server}",
        model_id=target_info["id"],
        model_revision=target_info["revision"],
        template_hash=target_info["chat_template_hash"],
        temperature=settings.temperature,
        top_p=settings.top_p,
        max_new_tokens=settings.max_new_tokens,
        seed=settings.seed,
        reasoning=settings.reasoning,
        chat_template_kwargs=dict(cfg.model.chat_template_kwargs),
        stop_tokens=[target_info["eos_token"]] if target_info.get("eos_token") else [],
        dtype=None if settings.base_url else regeneration_dtype(cfg),
    )


def regeneration_dtype(cfg: RunConfig) -> str:
    """The dtype the target writes replies in (the local backend, or the engine the stage starts)."""
    from tasks.common.devices import resolve_device, serving_dtype

    return serving_dtype(cfg.regeneration.dtype, cfg.model.dtype, resolve_device(cfg.runtime.device))


def settings_fingerprint(params: GenerationParams, cfg: RunConfig) -> str:
    """Identifies the target and the settings that change replies (tasks/data/reply_settings.py, which keys the
    stage's cache too); a journal written under others is not resumed. Transport, credentials and scheduling change
    no reply, so a longer timeout, a dropped replica or a new port resumes it. `params.backend` names the servers,
    so it is left out: the backend kind and engine are among the reply settings."""
    digest = hashlib.sha256()
    digest.update(params.model_dump_json(exclude={"backend"}).encode())
    digest.update(json.dumps(reply_settings(cfg), sort_keys=True).encode())
    return digest.hexdigest()


def input_hash(record: Optional[PromptRecord]) -> Optional[str]:
    """Identifies one input record; a journal entry is reused only for the very same record at its line."""
    if record is None:
        return None
    return hashlib.sha256(record.model_dump_json().encode()).hexdigest()


def open_generator(cfg: RunConfig, stack: ExitStack, target_info: dict[str, Any]) -> Generator:
    """The configured backend; an engine started for the stage is stopped when `stack` closes. A server must serve
    the target (tasks/data/served_model.py)."""
    settings = cfg.regeneration
    target_dir = cfg.output_path / "target"
    if settings.backend == "local":
        from tasks.data.generation_local import LocalGenerator

        return LocalGenerator(target_dir, settings, regeneration_dtype(cfg), cfg.model.chat_template_kwargs)
    from tasks.data.generation_openai import OpenAIGenerator

    from tasks.data.served_model import expected_name

    if settings.base_url is not None:
        return OpenAIGenerator(settings.endpoints, settings, template_kwargs=cfg.model.chat_template_kwargs,
                               expected_model=expected_name(settings, target_info))
    from tasks.serving.engine import serve

    log_path = cfg.output_path / "logs" / f"regenerate-{settings.engine}.log"
    launch = regeneration_launch(cfg, log_path)
    engine = stack.enter_context(serve(launch))
    return OpenAIGenerator(engine.base_url, settings, template_kwargs=cfg.model.chat_template_kwargs,
                           expected_model=(launch.served_model_name, "the engine this stage started"))


def regeneration_launch(cfg: RunConfig, log_path: Path):
    """The engine this stage starts: runtime.engines.<regeneration.engine> plus `regeneration.engine_env`, in the
    dtype `regeneration.dtype` resolves to."""
    from tasks.serving.engine import EngineLaunch

    settings = cfg.regeneration
    launch = EngineLaunch.from_config(settings.engine, cfg.runtime.engines[settings.engine],
                                      model=cfg.output_path / "target", log_path=log_path)
    launch.dtype = regeneration_dtype(cfg)
    launch.env.update(unredacted_mapping(settings.engine_env, "regeneration.engine_env"))
    return launch


def gate_over_length(cfg: RunConfig, todo: list[tuple[str, PromptRecord]]
                     ) -> tuple[list[dict[str, Any]], list[tuple[str, PromptRecord]]]:
    """(skipped journal entries of the records validate would drop whatever the target answers, the records to
    send): tasks/data/length_gate.py. A record that cannot be planned is sent on, to get its error entry where the
    stage plans it."""
    from tasks.common.target_info import load_tokenizer

    tokenizer = load_tokenizer(cfg.output_path / "target", cfg.model)
    skipped: list[dict[str, Any]] = []
    kept: list[tuple[str, PromptRecord]] = []
    for key, record in todo:
        item, _ = plan_record(key, record, cfg.regeneration.supervise, keep_responses=False)
        if item is None:
            kept.append((key, record))
            continue
        tokens = prompt_tokens(tokenizer, item.messages, item.slots[0])
        reason = over_length_reason(tokens, cfg.validation.max_length)
        if reason is None:
            kept.append((key, record))
        else:
            skipped.append(entry_for(key, record, "skipped", reason))
    return skipped, kept


def chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[start:start + size] for start in range(0, len(items), size)]


def plan_messages(record: PromptRecord, supervise: str, keep_responses: bool) -> list[Message]:
    """The turns to fill: assistant contents cleared (unless kept), a final slot after a trailing user turn."""
    if record.text is not None:
        raise PlanError("pre-templated text has no turns to regenerate")
    roles = [message.role for message in record.messages]
    if "user" not in roles:
        raise PlanError("no user turn to answer")
    first_turn = next(role for role in roles if role != "system")
    if first_turn == "assistant":
        raise PlanError("an assistant turn comes before the first user turn")
    messages = []
    for message in record.messages:
        if message.role == "assistant" and not keep_responses:
            messages.append(Message(role="assistant"))
        else:
            messages.append(message.model_copy())
    if messages[-1].role != "assistant":
        messages.append(Message(role="assistant"))
    slots = [index for index, message in enumerate(messages) if message.role == "assistant"]
    for index in slots:
        messages[index].supervised = supervise == "all" or index == slots[-1]
    if keep_responses and any(messages[index].content is None for index in slots):
        raise PlanError("an assistant turn is empty and regeneration is disabled")
    return messages


def request_seed(base_seed: int, record_id: str, turn: int) -> int:
    digest = hashlib.sha256(f"{base_seed}:{record_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF



def plan_record(key: str, record: PromptRecord, supervise: str,
                keep_responses: bool) -> tuple[Optional[PendingRecord], Optional[dict[str, Any]]]:
    """A record ready for its turns, or the journal entry saying why it has none (skipped / error)."""
    try:
        return PendingRecord(key, record, plan_messages(record, supervise, keep_responses)), None
    except PlanError as problem:
        status = "skipped" if record.text is not None else "error"
        return None, entry_for(key, record, status, str(problem))


def finished_entry(item: PendingRecord, params: GenerationParams) -> dict[str, Any]:
    """The journal entry of a record whose turns are all written (or that failed at one)."""
    if item.error is not None:
        return entry_for(item.key, item.record, "error", item.error)
    generation = params.model_copy(update={"turns": item.turns})
    finished = item.record.model_copy(update={"messages": item.messages, "generation": generation})
    return entry_for(item.key, item.record, "ok", None, finished)


def by_line(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(entries, key=lambda entry: int(entry["key"].rsplit(":", 1)[1]))


def regenerate_chunk(chunk: list[tuple[str, PromptRecord]], generator: Optional[Generator], cfg: RunConfig,
                     params: GenerationParams, stats: dict[str, float]) -> list[dict[str, Any]]:
    """Generate every turn of the chunk's records, round by round; return journal entries."""
    settings = cfg.regeneration
    pending: list[PendingRecord] = []
    entries: list[dict[str, Any]] = []
    for key, record in chunk:
        item, entry = plan_record(key, record, settings.supervise, generator is None)
        if item is None:
            entries.append(entry)
        else:
            pending.append(item)
    if generator is not None:
        run_rounds(pending, generator, settings, stats)
    entries.extend(finished_entry(item, params) for item in pending)
    stats["records"] += len(chunk)
    return by_line(entries)


def stream_records(todo: list[tuple[str, PromptRecord]], generator, cfg: RunConfig, params: GenerationParams,
                   stats: dict[str, float], commit: Callable[[list[dict[str, Any]]], None]) -> None:
    """Keep `concurrency` records in flight; commit finished ones every `chunk_records`."""
    asyncio.run(stream_records_async(todo, generator, cfg, params, stats, commit))


async def stream_records_async(todo: list[tuple[str, PromptRecord]], generator, cfg: RunConfig,
                               params: GenerationParams, stats: dict[str, float],
                               commit: Callable[[list[dict[str, Any]]], None]) -> None:
    settings = cfg.regeneration
    waiting = iter(todo)
    finished: list[dict[str, Any]] = []
    watch = RefusalWatch(f"{generator.base_url}/chat/completions")
    started = time.perf_counter()
    async with generator.client() as client:

        async def worker() -> None:
            for key, record in waiting:
                entry = await regenerate_record(key, record, generator, client, settings, params, stats, watch)
                if entry is not None:
                    finished.append(entry)
                if watch.stopped:
                    return
                if len(finished) >= settings.chunk_records:
                    commit_ready(finished, watch.held_keys, commit)

        await asyncio.gather(*(worker() for _ in range(min(generator.pool.capacity, len(todo)))))
    stats.update(generator.pool.metrics())
    if watch.stopped:
        commit_ready(finished, watch.held_keys, commit)
        raise watch.error()
    if finished:
        commit(by_line(finished))
    stats["generation_seconds"] += time.perf_counter() - started


def commit_ready(finished: list[dict[str, Any]], held_keys: set[str],
                 commit: Callable[[list[dict[str, Any]]], None]) -> None:
    """Commit the finished entries except those of a refusal streak still going, which stay in `finished`."""
    ready = [entry for entry in finished if entry["key"] not in held_keys]
    finished[:] = [entry for entry in finished if entry["key"] in held_keys]
    if ready:
        commit(by_line(ready))


async def regenerate_record(key: str, record: PromptRecord, generator, client, settings, params: GenerationParams,
                            stats: dict[str, float], watch: RefusalWatch) -> Optional[dict[str, Any]]:
    """One record's assistant turns in order, each sent as soon as the turn before it is written; None when the
    stage stopped before its last turn (a rerun does the record again)."""
    stats["records"] += 1
    item, entry = plan_record(key, record, settings.supervise, keep_responses=False)
    if item is None:
        return entry
    for turn in item.slots:
        if watch.stopped:
            return None
        reply = await generator.generate_one(client, turn_request(item, turn, settings.seed))
        watch.observe(key, reply)
        stats["completion_tokens"] += reply.completion_tokens
        apply_reply(item, reply, settings.reasoning)
        if item.error is not None:
            break
    return finished_entry(item, params)


def turn_request(item: PendingRecord, turn: int, base_seed: int) -> GenerationRequest:
    return GenerationRequest(item.record.id, turn, served_history(item.messages, turn), request_seed(base_seed, item.record.id, turn))


def run_rounds(pending: list[PendingRecord], generator: Generator, settings, stats: dict[str, float]) -> None:
    """Round k writes the k-th assistant turn of every record still going."""
    rounds = max((len(item.slots) for item in pending), default=0)
    for round_index in range(rounds):
        active = [item for item in pending if item.error is None and round_index < len(item.slots)]
        requests = [turn_request(item, item.slots[round_index], settings.seed) for item in active]
        started = time.perf_counter()
        replies = generator.generate(requests)
        stats["generation_seconds"] += time.perf_counter() - started
        for item, reply in zip(active, replies):
            stats["completion_tokens"] += reply.completion_tokens
            apply_reply(item, reply, settings.reasoning)


def apply_reply(item: PendingRecord, reply, reasoning_mode: str) -> None:
    if reply.error is not None:
        item.error = f"turn {reply.turn}: {reply.error}"
        return
    try:
        content, reasoning = split_reasoning(reply.text or "", reasoning_mode, reply.reasoning)
    except ReasoningError as problem:
        item.error = f"turn {reply.turn}: {problem}"
        return
    message = item.messages[reply.turn]
    message.content = content
    message.reasoning_content = reasoning
    item.turns.append(TurnGeneration(turn=reply.turn, finish_reason=reply.finish_reason, completion_tokens=reply.completion_tokens))


def entry_for(key: str, source: PromptRecord, status: str, reason: Optional[str], record: Optional[PromptRecord] = None) -> dict[str, Any]:
    outcome = Outcome(key=key, id=source.id, status=status, reason=reason)
    entry: dict[str, Any] = {"key": key, "input": input_hash(source), "outcome": outcome.model_dump(mode="json")}
    if record is not None:
        entry["record"] = record.model_dump(mode="json", exclude_none=True)
    return entry


def finish(cfg: RunConfig, records: list[tuple[str, PromptRecord]], done: dict[str, dict[str, Any]],
           stats: dict[str, float], journal: Journal) -> RegenerateResult:
    """Write the records in input order and the balanced report, then drop the journal."""
    data_dir = cfg.output_path / "data"
    ordered = [done[key] for key, _ in records]
    outcomes = [Outcome.model_validate(entry["outcome"]) for entry in ordered]
    source_of = {key: record.source for key, record in records}
    report = StageReport.from_outcomes("regenerate", outcomes, source_of)
    report.metrics = throughput(stats)
    output_path = data_dir / "regenerated.jsonl"
    report_path = data_dir / "regenerate_report.json"
    write_jsonl(output_path, (entry["record"] for entry in ordered if "record" in entry))
    write_json(report_path, report)
    journal.remove()
    return RegenerateResult(output_path, report_path, report)


def throughput(stats: dict[str, float]) -> dict[str, float]:
    """Tokens/s and records/s of the generation done by this invocation (a resumed run counts its part), and how
    many records it did not send because their first prompt is over validation.max_length."""
    seconds = stats["generation_seconds"]
    return {
        "completion_tokens": stats["completion_tokens"],
        "generation_seconds": round(seconds, 3),
        "tokens_per_second": round(stats["completion_tokens"] / seconds, 3) if seconds else 0.0,
        "records_per_second": round(stats["records"] / seconds, 3) if seconds else 0.0,
        "records_over_max_length": stats["records_over_max_length"],
        **{key: value for key, value in stats.items() if key.startswith("endpoint_")},
    }
