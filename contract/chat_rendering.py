"""Rendering conversations with the target's own chat template, and the assistant loss mask.

The mask comes from character offsets in the rendered text, never from guessing token patterns:
for each supervised assistant turn i, the text rendered up to the generation prompt of turn i is a prefix
of the text rendered through turn i, and what lies between them (trailing whitespace excluded) is exactly
what the target writes: the content and the template's end-of-turn marker. A turn the target did not finish
(regeneration stopped it at `max_new_tokens`, finish reason `length`) is supervised without that marker under
`validation.cut_turns: no_end` (the default): the target never ended the turn there, so the drafter must not learn
to predict the end of turn at that point. Every stage that needs masks
(validate, capture, `eaglet inspect`) calls this module, so they cannot disagree.

The tokenizer is passed in (duck-typed, an HF tokenizer); this module imports no torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Literal, Mapping, Sequence

from contract.records import Message, PromptRecord

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
#: What a turn cut at max_new_tokens becomes: supervised without the end-of-turn marker, supervised as if the
#: target had ended it (the old behaviour, kept to measure it), or its record dropped.
CutTurns = Literal["no_end", "as_finished", "drop"]
#: The finish reason of a generation stopped by the token budget (OpenAI API and our local backend).
CUT_FINISH_REASON = "length"
#: What an expanded record's samples append to its id and key: `#turn<i>`, i the turn's index in `messages`.
TURN_SUFFIX = "#turn"


class TemplateError(ValueError):
    """The chat template does not render this conversation consistently; the message says where."""


class HistoryRewritten(TemplateError):
    """The template renders an earlier turn differently once later turns follow (`render_samples` expands such a
    record per turn)."""


@dataclass
class RenderedConversation:
    text: str
    spans: list[tuple[int, int]]


@dataclass
class TokenizedSample:
    input_ids: list[int]
    loss_mask: list[int]
    offsets: list[tuple[int, int]]
    text: str
    truncated: bool

    @property
    def supervised_tokens(self) -> int:
        return sum(self.loss_mask)


def is_supervised(message: Message) -> bool:
    return message.role == "assistant" and message.supervised is not False


def template_content(message: Message) -> str:
    """The text the target produced for a turn: reasoning (if saved) in think tags, then the answer."""
    if message.content is None:
        raise TemplateError(f"{message.role} turn has no content to render")
    if message.reasoning_content:
        return f"{THINK_OPEN}{message.reasoning_content}{THINK_CLOSE}{message.content}"
    return message.content


def template_messages(messages: Sequence[Message]) -> list[dict[str, str]]:
    return [{"role": message.role, "content": template_content(message)} for message in messages]


#: The attribute a loaded tokenizer carries `model.chat_template_kwargs` in (`bind_template_kwargs`), so every
#: rendering of a run passes the same template variables without each caller threading them through.
TEMPLATE_KWARGS_ATTRIBUTE = "eaglet_chat_template_kwargs"


def bind_template_kwargs(tokenizer: Any, kwargs: Mapping[str, Any]) -> Any:
    """The tokenizer, from now on rendered with `kwargs` as extra chat-template variables."""
    setattr(tokenizer, TEMPLATE_KWARGS_ATTRIBUTE, dict(kwargs))
    return tokenizer


def template_kwargs(tokenizer: Any) -> dict[str, Any]:
    """The chat-template variables bound to this tokenizer (none unless `bind_template_kwargs` was called)."""
    return dict(getattr(tokenizer, TEMPLATE_KWARGS_ATTRIBUTE, None) or {})


def served_history(messages: Sequence[Message], turn: int) -> list[dict[str, str]]:
    """The chat messages before `turn` as a client sends them to a server (regeneration does): earlier assistant
    turns carry their answer only, never their reasoning."""
    return [{"role": message.role, "content": message.content or ""} for message in messages[:turn]]


def served_prompt(tokenizer: Any, messages: Sequence[Message], turn: int) -> str:
    """What the serving engine renders before assistant turn `turn`: the template (with the bound template
    variables, as requests carry them) over the served history, with the generation prompt."""
    return tokenizer.apply_chat_template(served_history(messages, turn), tokenize=False, add_generation_prompt=True,
                                         **template_kwargs(tokenizer))


def render(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """The chat template applied to `messages`, as text, with the tokenizer's bound template variables."""
    return tokenizer.apply_chat_template(
        template_messages(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
        **template_kwargs(tokenizer),
    )


def unfinished_turns(record: PromptRecord) -> frozenset[int]:
    """Indexes (in `messages`) of the assistant turns regeneration stopped at its token budget."""
    if record.generation is None:
        return frozenset()
    return frozenset(turn.turn for turn in record.generation.turns if turn.finish_reason == CUT_FINISH_REASON)


def render_record(tokenizer: Any, record: PromptRecord, cut_turns: CutTurns) -> RenderedConversation:
    """A record as every stage renders it: pre-templated text by its markers, messages by the chat template,
    with the turns the target did not finish ending without the end-of-turn marker under `no_end`."""
    if record.text is not None:
        return spans_in_pretemplated(tokenizer, record.text)
    unfinished = unfinished_turns(record) if cut_turns == "no_end" else frozenset()
    return render_with_spans(tokenizer, record.messages, unfinished)


@dataclass
class TurnSample:
    """One training sample of a record: the whole record (`suffix` ""), or one turn of an expanded record
    (`suffix` "#turn<i>", i its index in `messages`)."""

    suffix: str
    rendered: RenderedConversation


def turn_messages(messages: Sequence[Message], index: int) -> list[Message]:
    """The conversation through turn `index`, with only that turn supervised (the history as the template renders
    it: earlier assistant turns keep their text and the template decides what of their reasoning it shows)."""
    return [message if position == index or not is_supervised(message)
            else message.model_copy(update={"supervised": False})
            for position, message in enumerate(messages[: index + 1])]


def render_samples(tokenizer: Any, record: PromptRecord, cut_turns: CutTurns) -> list[TurnSample]:
    """The samples a record trains as: itself, or, when its template renders an earlier turn differently once later
    turns follow (reasoning templates such as Qwen3's drop earlier turns' reasoning and think blocks from the
    history), one sample per supervised turn: the conversation through that turn, as the target saw it then."""
    try:
        return [TurnSample("", render_record(tokenizer, record, cut_turns))]
    except HistoryRewritten:
        if sum(1 for message in record.messages if is_supervised(message)) < 2:
            raise
    unfinished = unfinished_turns(record) if cut_turns == "no_end" else frozenset()
    samples = []
    for index, message in enumerate(record.messages):
        if is_supervised(message):
            cut = [index] if index in unfinished else []
            rendered = render_with_spans(tokenizer, turn_messages(record.messages, index), cut)
            samples.append(TurnSample(f"{TURN_SUFFIX}{index}", rendered))
    return samples


def prompt_mismatches(tokenizer: Any, record: PromptRecord, samples: Sequence[TurnSample]) -> list[str]:
    """Each supervised turn whose training prompt (the sample's text before the turn) is not what the engine renders
    for the served history: the drafter would learn from a context the target never sees. Empty when all match."""
    supervised = [index for index, message in enumerate(record.messages) if is_supervised(message)]
    problems = []
    for sample in samples:
        turns = [int(sample.suffix[len(TURN_SUFFIX):])] if sample.suffix else supervised
        for index, (start, _) in zip(turns, sample.rendered.spans):
            ours, served = sample.rendered.text[:start], served_prompt(tokenizer, record.messages, index)
            if ours != served:
                at = next((i for i, (a, b) in enumerate(zip(ours, served)) if a != b), min(len(ours), len(served)))
                problems.append(f"turn {index}: the training prompt differs from what the engine renders for the "
                                f"served messages at character {at}: ours {ours[at:at + 40]!r}, engine's "
                                f"{served[at:at + 40]!r}")
    return problems


def render_with_spans(tokenizer: Any, messages: Sequence[Message], unfinished: Collection[int] = ()) -> RenderedConversation:
    """Render a conversation and locate every supervised assistant turn in the text (a turn in `unfinished`
    spans its content only, not the end-of-turn marker after it)."""
    full = render(tokenizer, messages)
    spans = []
    for index, message in enumerate(messages):
        if not is_supervised(message):
            continue
        prefix = render(tokenizer, messages[:index], add_generation_prompt=True)
        through = render(tokenizer, messages[: index + 1])
        if not through.startswith(prefix) or not full.startswith(through):
            raise HistoryRewritten(f"turn {index}: the template does not render earlier turns as a prefix of later ones")
        content = template_content(message)
        if not through[len(prefix):].startswith(content):
            raise TemplateError(f"turn {index}: the template changes the assistant content while rendering it")
        end = len(prefix) + len(content) if index in unfinished else len(through.rstrip())
        spans.append((len(prefix), end))
    return RenderedConversation(full, spans)


def assistant_markers(tokenizer: Any) -> tuple[str, str]:
    """(header that opens an assistant turn, marker that closes it), read off the template itself."""
    user = [Message(role="user", content="x")]
    asked = render(tokenizer, user)
    header = render(tokenizer, user, add_generation_prompt=True)[len(asked):]
    answered = render(tokenizer, [*user, Message(role="assistant", content="y")])
    closing = answered[len(asked) + len(header) + 1:].rstrip()
    if not header or not closing:
        raise TemplateError("cannot read the assistant header and end-of-turn marker from the chat template")
    return header, closing


def spans_in_pretemplated(tokenizer: Any, text: str) -> RenderedConversation:
    """Assistant spans of text that was templated upstream: from each header to its closing marker."""
    header, closing = assistant_markers(tokenizer)
    spans = []
    position = text.find(header)
    while position != -1:
        start = position + len(header)
        end = text.find(closing, start)
        if end == -1:
            raise TemplateError(f"assistant turn at character {start} has no closing {closing!r}")
        spans.append((start, end + len(closing)))
        position = text.find(header, end)
    return RenderedConversation(text, spans)


def tokenize_with_mask(tokenizer: Any, rendered: RenderedConversation, max_length: int) -> TokenizedSample:
    """Token ids, per-token loss mask (1 where the token overlaps a supervised span) and offsets."""
    encoded = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    offsets = [tuple(pair) for pair in encoded["offset_mapping"]]
    mask = [int(any(start < span_end and end > span_start for span_start, span_end in rendered.spans)) for start, end in offsets]
    truncated = len(ids) > max_length
    return TokenizedSample(ids[:max_length], mask[:max_length], offsets[:max_length], rendered.text, truncated)
