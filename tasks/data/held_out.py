"""The held-out records that evaluate decodes, benchmark serves and register fingerprints, and the prompts made
of them.

All three stages must see exactly the same prompts, so they all select them here; the benchmark's agreement run
replays `eval_prompts` (the very token ids evaluate decodes) on the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from contract.chat_rendering import RenderedConversation, is_supervised, render_samples
from contract.records import Message, PromptRecord, read_prompt_records


LENGTH_BUCKETS = (256, 512, 1024)


@dataclass
class EvalPrompt:
    id: str
    turn: int
    source: str
    category: str
    input_ids: list[int]

    @property
    def key(self) -> str:
        return f"{self.id}#turn{self.turn}"

    @property
    def length_bucket(self) -> str:
        for bound in LENGTH_BUCKETS:
            if len(self.input_ids) < bound:
                return f"<{bound}"
        return f">={LENGTH_BUCKETS[-1]}"


def eval_prompts(path: Path, tokenizer: Any, max_length: int, max_records: Optional[int],
                 sources: Optional[list[str]] = None) -> list[EvalPrompt]:
    """One prompt per supervised assistant turn of each held-out record from `sources` (all when None);
    with `max_records`, that many records evenly spaced through the file (so every category is sampled)."""
    prompts = record_prompts(select_records(path, max_records, sources), tokenizer, max_length)
    if not prompts:
        wanted = f" from sources {sources}" if sources else ""
        raise ValueError(f"{path}: no evaluation prompt{wanted} (no supervised assistant turn within {max_length} tokens)")
    return prompts


def record_prompts(records: Sequence[PromptRecord], tokenizer: Any, max_length: int) -> list[EvalPrompt]:
    """One prompt per supervised assistant turn of each record, up to the first that reaches `max_length` tokens."""
    prompts: list[EvalPrompt] = []
    for record in records:
        starts = [start for sample in render_samples(tokenizer, record, "as_finished")  # only prompts are used
                  for start in sample_prompts(sample.rendered)]
        for turn, (text, start) in enumerate(starts, start=1):
            ids = tokenizer(text[:start], add_special_tokens=False)["input_ids"]
            if len(ids) >= max_length:
                break  # later turns are longer still
            prompts.append(EvalPrompt(record.id, turn, record.source, record.metadata.get("category", "-"), ids))
    return prompts


def set_prompts(path: Path, tokenizer: Any, max_length: int, sets: Sequence[Any]) -> list[EvalPrompt]:
    """The prompts of every evaluation set (`evaluation.sets`): each set's records spread over its categories."""
    records = read_records(path)
    prompts: list[EvalPrompt] = []
    for item in sets:
        chosen = stratified([record for record in records if record.source == item.source], item.records)
        if not chosen:
            raise ValueError(f"{path}: evaluation.sets names source '{item.source}', which has no held-out record "
                             f"(data.sources must list it, with split eval)")
        prompts += record_prompts(chosen, tokenizer, max_length)
    return prompts


def stratified(records: list[PromptRecord], count: Optional[int]) -> list[PromptRecord]:
    """`count` records (all when None) spread over their categories: one per category in turn (file order of the
    categories) while it has records left, taken evenly spaced within each category; in file order."""
    if count is None or count >= len(records):
        return records
    groups: dict[str, list[int]] = {}
    for index, record in enumerate(records):
        groups.setdefault(record.metadata.get("category", "-"), []).append(index)
    quotas = dict.fromkeys(groups, 0)
    taken = 0
    while taken < count:
        for name, members in groups.items():
            if taken < count and quotas[name] < len(members):
                quotas[name] += 1
                taken += 1
    chosen: list[int] = []
    for name, members in groups.items():
        take = quotas[name]
        chosen += [members[position * len(members) // take] for position in range(take)]
    return [records[index] for index in sorted(chosen)]


def sample_prompts(rendered: RenderedConversation) -> list[tuple[str, int]]:
    """(text, where each supervised turn starts) of one rendered sample: the prompt is the text before it."""
    return [(rendered.text, start) for start, _ in rendered.spans]


def select_records(path: Path, max_records: Optional[int], sources: Optional[list[str]]) -> list[PromptRecord]:
    """The held-out records evaluated (and benchmarked: both stages must see the same prompts)."""
    records = [record for record in read_records(path) if sources is None or record.source in sources]
    if max_records is not None and len(records) > max_records:
        records = [records[index * len(records) // max_records] for index in range(max_records)]
    return records


def turn_prefixes(record: PromptRecord) -> list[list[Message]]:
    """The conversation before each supervised assistant turn: what a chat client sends for that turn."""
    return [record.messages[:index] for index, message in enumerate(record.messages) if is_supervised(message)]


def read_records(path: Path) -> list[PromptRecord]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no held-out records; run the validate stage first")
    return [record for _, record in read_prompt_records(path)]
