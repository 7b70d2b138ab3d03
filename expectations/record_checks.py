"""Per-record columns that the record suite (`regenerated_records.json`) checks, one row per input line.

Deriving a column is plain Python (parse the line, render it with the target's chat template, tokenise it);
judging it is GX's job: every pass/fail in the data contract comes from a real expectation over these
columns. A column is None where its check does not apply (GX map expectations skip nulls): every column
of a line that does not parse, and the role and marker columns of pre-templated `text` records.
Beside each value, `details` keeps a sentence saying what is wrong with it, for the stage report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import ValidationError

from contract.chat_rendering import (
    THINK_CLOSE,
    THINK_OPEN,
    CutTurns,
    RenderedConversation,
    TemplateError,
    is_supervised,
    render,
    prompt_mismatches,
    render_samples,
    template_kwargs,
    tokenize_with_mask,
    unfinished_turns,
)
from contract.records import Message, PromptRecord

# The columns, in frame order. `key` (regenerated.jsonl:<line>) is the row's handle in GX results.
COLUMNS = (
    "key",
    "id",
    "parsed",
    "role_sequence",
    "assistant_targets",
    "contents",
    "reasoning_content",
    "template_hash",
    "template_renders",
    "tokens_roundtrip",
    "supervised_tokens",
    "cut_turns",
    "turn_samples",
    "serving_prompts_match",
)
UNSUPERVISED_ASSISTANT = "assistant-unsupervised"
MISSING_HASH = "<missing>"
_SENTINEL = "\u2063eaglet-sentinel\u2063"


@dataclass
class DerivedRecord:
    """One input line: the record (when it parses), its column values and what is wrong with each."""

    key: str
    line: int
    record: Optional[PromptRecord]
    columns: dict[str, Any]
    details: dict[str, str] = field(default_factory=dict)
    first_prompt: Optional[str] = None

    @property
    def label(self) -> str:
        """The record id, or the line key when the line has no id."""
        return self.columns.get("id") or self.key


@dataclass(frozen=True)
class CheckSettings:
    max_length: int
    reasoning_mode: str
    chat_template_hash: Optional[str]
    cut_turns: CutTurns = "no_end"


def derive(lines: list[str], tokenizer: Any, settings: CheckSettings, file_name: str = "regenerated.jsonl") -> list[DerivedRecord]:
    """One DerivedRecord per line (1-based line numbers)."""
    markers = _Markers(tokenizer)
    return [derive_line(number, line, tokenizer, settings, markers, file_name) for number, line in enumerate(lines, 1)]


def derive_line(number: int, line: str, tokenizer: Any, settings: CheckSettings, markers: "_Markers",
                file_name: str = "regenerated.jsonl") -> DerivedRecord:
    key = f"{file_name}:{number}"
    columns: dict[str, Any] = {name: None for name in COLUMNS}
    columns.update(key=key, parsed=False)
    derived = DerivedRecord(key, number, None, columns)
    record, problem = parse_line(line)
    if record is None:
        derived.details["parsed"] = f"line {number}: {problem}"
        return derived
    derived.record = record
    columns.update(id=record.id, parsed=True)
    if record.text is None:
        _message_columns(derived, record, settings)
    else:
        columns["reasoning_content"] = False
    _template_columns(derived, record, tokenizer, settings, markers)
    return derived


def parse_line(line: str) -> tuple[Optional[PromptRecord], str]:
    """(record, "") or (None, why the line is not a PromptRecord)."""
    if not line.strip():
        return None, "blank line"
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        return None, f"not valid JSON: {error}"
    try:
        return PromptRecord.model_validate(data), ""
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "record"
        return None, f"not a valid PromptRecord ({error.error_count()} problem(s)); {where}: {first['msg']}"


def role_sequence(messages: list[Message]) -> str:
    """Roles joined by commas; an assistant turn marked unsupervised reads `assistant-unsupervised`."""
    names = []
    for message in messages:
        unsupervised = message.role == "assistant" and not is_supervised(message)
        names.append(UNSUPERVISED_ASSISTANT if unsupervised else message.role)
    return ",".join(names)


def _message_columns(derived: DerivedRecord, record: PromptRecord, settings: CheckSettings) -> None:
    columns, details = derived.columns, derived.details
    messages = record.messages
    columns["role_sequence"] = role_sequence(messages)
    details["role_sequence"] = (
        f"role order '{columns['role_sequence']}' (want: optional system, then user/assistant alternating "
        "from user, ending with a supervised assistant turn)"
    )
    targets = [(index, message.content) for index, message in enumerate(messages) if message.role == "assistant"]
    columns["assistant_targets"] = tuple(content or "" for _, content in targets)
    blank = [index for index, content in targets if not (content or "").strip()]
    details["assistant_targets"] = f"assistant turn(s) {blank} empty or whitespace-only"
    columns["contents"] = tuple(message.content or "" for message in messages)
    marked = [index for index, message in enumerate(messages)
              if THINK_OPEN in (message.content or "") or THINK_CLOSE in (message.content or "")]
    details["contents"] = f"unparsed {THINK_OPEN}/{THINK_CLOSE} in the content of turn(s) {marked}"
    reasoning = [index for index, message in enumerate(messages) if message.reasoning_content is not None]
    columns["reasoning_content"] = bool(reasoning)
    details["reasoning_content"] = (
        f"reasoning_content on turn(s) {reasoning} but regeneration.reasoning is '{settings.reasoning_mode}'"
    )


def _template_columns(derived: DerivedRecord, record: PromptRecord, tokenizer: Any, settings: CheckSettings,
                      markers: "_Markers") -> None:
    columns, details = derived.columns, derived.details
    recorded = record.generation.template_hash if record.generation is not None else None
    if record.text is not None and record.generation is None:
        columns["template_hash"] = None  # templated upstream: there is no generation to compare
    else:
        columns["template_hash"] = recorded or MISSING_HASH
    details["template_hash"] = (
        f"generation.template_hash {_short(recorded)} != target chat_template_hash {_short(settings.chat_template_hash)}"
    )
    rendered_with = template_kwargs(tokenizer)
    if record.generation is not None and record.generation.chat_template_kwargs != rendered_with:
        generated_with = json.dumps(record.generation.chat_template_kwargs, sort_keys=True)
        columns["template_hash"] = f"<chat_template_kwargs {generated_with}>"
        details["template_hash"] = (f"generated with chat_template_kwargs {generated_with}, but this run renders with "
                                    f"model.chat_template_kwargs {json.dumps(rendered_with, sort_keys=True)}: the "
                                    "target saw other prompts than training would render")
    columns["cut_turns"] = len(unfinished_turns(record))
    details["cut_turns"] = (f"{columns['cut_turns']} assistant turn(s) cut at regeneration.max_new_tokens "
                            f"(validation.cut_turns: {settings.cut_turns})")
    try:
        turns = render_samples(tokenizer, record, settings.cut_turns)
        samples = [turn.rendered for turn in turns]
        if record.text is not None:
            derived.first_prompt = markers.first_user_prompt(record.text)
            columns["assistant_targets"] = tuple(markers.target_text(record.text, span) for span in samples[0].spans)
            details["assistant_targets"] = "a pre-templated assistant turn is empty or whitespace-only"
    except Exception as error:  # a jinja error from the template is as much a render failure as TemplateError
        columns["template_renders"] = False
        kind = "" if isinstance(error, TemplateError) else f"{type(error).__name__}: "
        details["template_renders"] = f"the chat template does not render it: {kind}{error}"
        return
    columns["template_renders"] = True
    columns["turn_samples"] = len(turns) if turns[0].suffix else 0
    if record.text is None:
        problems = prompt_mismatches(tokenizer, record, turns)
        columns["serving_prompts_match"] = not problems
        details["serving_prompts_match"] = "; ".join(problems)
    _token_columns(derived, samples, tokenizer, settings)


def _token_columns(derived: DerivedRecord, samples: list[RenderedConversation], tokenizer: Any,
                   settings: CheckSettings) -> None:
    """Over the record's samples (one, or one per turn of an expanded record): ids that decode back to the text,
    and the supervised tokens left within validation.max_length."""
    columns, details = derived.columns, derived.details
    columns["tokens_roundtrip"], kept, tokens, supervised = True, 0, 0, 0
    for rendered in samples:
        full = tokenize_with_mask(tokenizer, rendered, max_length=1 << 62)
        decoded = tokenizer.decode(full.input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if decoded != rendered.text and columns["tokens_roundtrip"]:
            columns["tokens_roundtrip"] = False
            at = next((i for i, (a, b) in enumerate(zip(decoded, rendered.text)) if a != b),
                      min(len(decoded), len(rendered.text)))
            details["tokens_roundtrip"] = (
                f"decoding its {len(full.input_ids)} token ids does not give back the rendered text "
                f"(first difference at character {at})"
            )
        kept += sum(full.loss_mask[: settings.max_length])
        tokens += len(full.input_ids)
        supervised += full.supervised_tokens
    columns["supervised_tokens"] = kept
    details["supervised_tokens"] = (
        f"{kept} supervised token(s) left after truncation to validation.max_length "
        f"{settings.max_length} (the record has {tokens} tokens, {supervised} supervised)"
    )


def _short(value: Optional[str]) -> str:
    return f"{value[:12]}…" if value else "(none)"


class _Markers:
    """The template's user and assistant turn markers, read off the template once, for pre-templated text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._user: Optional[tuple[str, str]] = None
        self._closing: Optional[str] = None

    def _around(self, role: str) -> tuple[str, str]:
        probe = [Message(role="user", content="x")] if role == "assistant" else []
        messages = [*probe, Message(role=role, content=_SENTINEL)]
        text = render(self.tokenizer, messages)
        before, after = text.split(_SENTINEL, 1)
        if probe:
            before = before[len(render(self.tokenizer, probe)):]
        return before, after.rstrip()

    def first_user_prompt(self, text: str) -> Optional[str]:
        if self._user is None:
            self._user = self._around("user")
        header, closing = self._user
        start = text.find(header) if header else -1
        if start == -1 or not closing:
            return None
        start += len(header)
        end = text.find(closing, start)
        return text[start:end] if end != -1 else None

    def target_text(self, text: str, span: tuple[int, int]) -> str:
        """The answer inside an assistant span (the span includes the closing marker)."""
        if self._closing is None:
            self._closing = self._around("assistant")[1]
        body = text[span[0]:span[1]]
        return body[: -len(self._closing)] if self._closing and body.endswith(self._closing) else body
