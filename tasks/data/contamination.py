"""Decontamination: how much of each held-out prompt the training records already contain, by word n-grams.

A drafter evaluated on prompts it was trained on reports acceptance it will not see in service. The split keeps a
conversation and its first prompt on one side (tasks/data/split.py), but a benchmark question can also reach the
training data inside another conversation (a ShareGPT user pasting an MT-bench question, a code set sharing
HumanEval's problems). The check the field uses (GPT-3's and Llama's contamination studies) compares word n-grams:
every user turn of a held-out record is a prompt; its overlap is the share of its n-grams that occur anywhere in the
training records' text (every message, user and assistant). Prompts shorter than n words are not checked: a
greeting that a chat set repeats word for word is no leak of a benchmark.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from contract.records import PromptRecord

#: Words per n-gram: 13 is the length GPT-3's decontamination used; long enough that common phrases do not match.
DEFAULT_NGRAM = 13
WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class PromptOverlap:
    """One held-out prompt (record id and user turn) and the share of its n-grams found in the training records."""

    id: str
    turn: int
    source: str
    ngrams: int
    overlap: float


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words: punctuation, case and spacing do not hide a copy."""
    return WORD.findall(text.lower())


def ngrams(tokens: Sequence[str], size: int) -> set[tuple[str, ...]]:
    """The text's n-grams (none for a text shorter than `size` words)."""
    return {tuple(tokens[start:start + size]) for start in range(len(tokens) - size + 1)}


def record_texts(record: PromptRecord) -> list[str]:
    return [message.content for message in record.messages] if record.messages else [record.text or ""]


def training_ngrams(records: Iterable[PromptRecord], size: int) -> set[tuple[str, ...]]:
    """Every n-gram of every training record's text."""
    found: set[tuple[str, ...]] = set()
    for record in records:
        for text in record_texts(record):
            found |= ngrams(words(text), size)
    return found


def prompt_overlaps(held_out: Iterable[PromptRecord], train: Iterable[PromptRecord],
                    size: int = DEFAULT_NGRAM) -> list[PromptOverlap]:
    """Per user turn of each held-out record, the share of its n-grams that the training records contain."""
    seen = training_ngrams(train, size)
    overlaps = []
    for record in held_out:
        turns = [message.content for message in record.messages if message.role == "user"] if record.messages \
            else [record.text or ""]
        for turn, text in enumerate(turns, start=1):
            grams = ngrams(words(text), size)
            if not grams:
                continue
            shared = sum(gram in seen for gram in grams)
            overlaps.append(PromptOverlap(record.id, turn, record.source, len(grams), shared / len(grams)))
    return overlaps


def contamination_summary(overlaps: Sequence[PromptOverlap], max_overlap: float, size: int) -> dict[str, object]:
    """The data contract's decontamination section: per source the prompts checked, their mean and largest overlap
    and how many reach `max_overlap`; every such prompt by id."""
    by_source: dict[str, dict[str, float]] = {}
    for source in sorted({overlap.source for overlap in overlaps}):
        chosen = [overlap.overlap for overlap in overlaps if overlap.source == source]
        by_source[source] = {"prompts": len(chosen), "mean_overlap": sum(chosen) / len(chosen),
                             "max_overlap": max(chosen), "contaminated": sum(value >= max_overlap for value in chosen)}
    contaminated = [{"id": overlap.id, "turn": overlap.turn, "source": overlap.source, "overlap": overlap.overlap}
                    for overlap in sorted(overlaps, key=lambda item: -item.overlap) if overlap.overlap >= max_overlap]
    return {"ngram_words": size, "max_prompt_overlap": max_overlap, "prompts": len(overlaps),
            "contaminated": contaminated, "by_source": by_source}
