"""The train/eval split: deterministic, grouped, leak-free. Pure Python (no GX, no tokenizer).

Records that share a conversation id or a normalised first user prompt form one group (union-find), and a
group lands in one split as a whole:

- eval, when any member asked for `split == "eval"` (MT-bench is eval-only: a train-candidate record
  repeating an MT-bench question follows it into eval);
- else train, when any member asked for `split == "train"`;
- else by a seeded hash of the group key (its smallest member key) against `eval_fraction`.

The conversation id is the part of `provenance.original_id` (or of the record id, less its `source:` prefix)
that names the conversation: `conversation_id_pattern`'s group `conversation` (by default it drops
ShareGPT's `_<n>` part suffix, so the parts of one long conversation stay together). It is compared across
sources on purpose: the same conversation ingested twice must not straddle the split.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Literal, Optional, Sequence

from contract.config import ValidationConfig
from contract.records import PromptRecord

Split = Literal["train", "eval"]
DEFAULT_CONVERSATION_PATTERN: str = ValidationConfig.model_fields["conversation_id_pattern"].default

_SPACES = re.compile(r"\s+")
_EDGE_PUNCTUATION = re.compile(r"^[\W_]+|[\W_]+$")


@dataclass(frozen=True)
class SplitCandidate:
    """What the split needs to know about one record."""

    id: str
    conversation: str
    prompt: str
    requested: str = "auto"

    def keys(self) -> list[str]:
        """The keys that tie this record to others: its conversation, and its prompt when it has one."""
        keys = [f"conversation:{self.conversation}"]
        if self.prompt:
            keys.append(f"prompt:{self.prompt}")
        return keys


def normalise_prompt(text: Optional[str]) -> str:
    """Lowercase, collapse whitespace, strip punctuation (and symbols) at both ends."""
    if not text:
        return ""
    collapsed = _SPACES.sub(" ", text.lower()).strip()
    return _EDGE_PUNCTUATION.sub("", collapsed)


def first_user_prompt(record: PromptRecord) -> Optional[str]:
    """The content of the first user turn (None for pre-templated `text` records or when there is none)."""
    for message in record.messages:
        if message.role == "user":
            return message.content
    return None


def conversation_id(record: PromptRecord, pattern: str = DEFAULT_CONVERSATION_PATTERN) -> str:
    """The conversation a record belongs to (see the module docstring)."""
    raw = record.provenance.original_id
    if not raw:
        prefix = f"{record.source}:"
        raw = record.id[len(prefix):] if record.id.startswith(prefix) else record.id
    match = re.match(pattern, raw)
    if match is None or not match.groupdict().get("conversation"):
        return raw
    return match.group("conversation")


def candidate(
    record: PromptRecord, pattern: str = DEFAULT_CONVERSATION_PATTERN, first_prompt: Optional[str] = None
) -> SplitCandidate:
    """A record as the split sees it; `first_prompt` overrides the prompt (for pre-templated text)."""
    prompt = first_prompt if first_prompt is not None else first_user_prompt(record)
    return SplitCandidate(record.id, conversation_id(record, pattern), normalise_prompt(prompt), record.split)


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, key: str) -> str:
        self.parent.setdefault(key, key)
        root = key
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[key] != root:
            self.parent[key], key = root, self.parent[key]
        return root

    def union(self, first: str, second: str) -> None:
        a, b = self.find(first), self.find(second)
        if a != b:
            # The smaller key becomes the root, so a group's root is its smallest key whatever the order.
            if b < a:
                a, b = b, a
            self.parent[b] = a


def groups(candidates: Sequence[SplitCandidate]) -> list[list[int]]:
    """Indices of `candidates`, grouped by shared conversation or prompt; each group keyed by its root."""
    union = _UnionFind()
    for item in candidates:
        keys = item.keys()
        for key in keys[1:]:
            union.union(keys[0], key)
        union.find(keys[0])
    members: dict[str, list[int]] = defaultdict(list)
    for index, item in enumerate(candidates):
        members[union.find(item.keys()[0])].append(index)
    return [members[root] for root in sorted(members)]


def hashed_fraction(key: str, seed: int) -> float:
    """A uniform number in [0, 1) determined by (seed, key) only."""
    digest = hashlib.sha256(f"{seed}\0{key}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def assign_splits(candidates: Sequence[SplitCandidate], eval_fraction: float, seed: int) -> list[Split]:
    """The split of each candidate (same order). Deterministic in (candidates as a set, fraction, seed)."""
    assignment: list[Split] = ["train"] * len(candidates)
    for members in groups(candidates):
        requested = {candidates[index].requested for index in members}
        if "eval" in requested:
            split: Split = "eval"
        elif "train" in requested:
            split = "train"
        else:
            key = min(key for index in members for key in candidates[index].keys())
            split = "eval" if hashed_fraction(key, seed) < eval_fraction else "train"
        for index in members:
            assignment[index] = split
    return assignment


def crossing_keys(candidates: Iterable[SplitCandidate], assignment: Iterable[str]) -> dict[str, set[str]]:
    """Every conversation or prompt key and the set of splits it appears in (a leak: more than one)."""
    splits: dict[str, set[str]] = defaultdict(set)
    for item, split in zip(candidates, assignment):
        for key in item.keys():
            splits[key].add(split)
    return splits
