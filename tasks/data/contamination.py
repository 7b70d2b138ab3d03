"""Decontamination: how much of each held-out prompt the training records already contain, by word n-grams.

A drafter evaluated on prompts it was trained on reports acceptance it will not see in service. The split keeps a
conversation and its first prompt on one side (tasks/data/split.py), but a benchmark question can also reach the
training data inside another conversation (a ShareGPT user pasting an MT-bench question, a code set sharing
HumanEval's problems). The check the field uses (GPT-3's and Llama's contamination studies) compares word n-grams:
every user turn of a held-out record is a prompt; its overlap is the share of its n-grams that occur anywhere in the
training records' text (every message, user and assistant). Prompts shorter than n words are not checked: a
greeting that a chat set repeats word for word is no leak of a benchmark.

Memory is bounded by the held-out side: the held-out prompts' n-grams are indexed (thousands of prompts) and the
training text streams past them one message at a time, so the training records' 10^8-10^9 n-grams (~300k
conversations) are never held at once. The index keeps each n-gram's 64-bit hash, not the tuple; a training n-gram
whose hash is indexed is kept as the real tuple, and a prompt counts only the n-grams equal to such a tuple, so a
hash collision costs one extra tuple and can neither add nor drop a shared n-gram.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from contract.records import PromptRecord

#: Words per n-gram: 13 is the length GPT-3's decontamination used; long enough that common phrases do not match.
DEFAULT_NGRAM = 13
WORD = re.compile(r"[a-z0-9]+")

Gram = tuple[str, ...]
GramHash = Callable[[Gram], int]


@dataclass(frozen=True)
class PromptOverlap:
    """One held-out prompt (record id and user turn) and the share of its n-grams found in the training records."""

    id: str
    turn: int
    source: str
    ngrams: int
    overlap: float


@dataclass(frozen=True)
class HeldOutPrompt:
    """One held-out user turn to check: its words (its n-grams are re-derived from them, not stored)."""

    id: str
    turn: int
    source: str
    tokens: list[str]


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words: punctuation, case and spacing do not hide a copy."""
    return WORD.findall(text.lower())


def gram_sequence(tokens: Sequence[str], size: int) -> Iterator[Gram]:
    """The text's n-grams in order, repeats included, built in C (zip over shifted slices) without a set."""
    return zip(*(tokens[offset:] for offset in range(size)))


def ngrams(tokens: Sequence[str], size: int) -> set[Gram]:
    """The text's n-grams (none for a text shorter than `size` words)."""
    return set(gram_sequence(tokens, size))


def record_texts(record: PromptRecord) -> list[str]:
    return [message.content for message in record.messages] if record.messages else [record.text or ""]


def prompt_turns(record: PromptRecord) -> list[str]:
    """A held-out record's prompts: its user turns (its text when it has no messages)."""
    if not record.messages:
        return [record.text or ""]
    return [message.content for message in record.messages if message.role == "user"]


class HeldOutIndex:
    """The held-out prompts' n-gram hashes, and the training n-grams seen so far that match one.

    `gram_hash` maps an n-gram to a 64-bit int (Python's tuple hash by default). With a uniform 64-bit hash,
    10^9 training n-grams against 10^6 held-out ones expect 10^15 / 2^64 ~ 5e-5 false candidates per run; each is
    one tuple more in `matched` and never equals a held-out n-gram, so results are exact whatever the hash.
    """

    def __init__(self, held_out: Iterable[PromptRecord], size: int, gram_hash: GramHash = hash) -> None:
        self.size = size
        self.gram_hash = gram_hash
        self.prompts = [HeldOutPrompt(record.id, turn, record.source, words(text or ""))
                        for record in held_out for turn, text in enumerate(prompt_turns(record), start=1)]
        self.hashes = {gram_hash(gram) for prompt in self.prompts for gram in gram_sequence(prompt.tokens, size)}
        self.matched: set[Gram] = set()

    def scan(self, text: str) -> None:
        """Keep the n-grams of one training text whose hash a held-out n-gram has (most texts have none)."""
        tokens = words(text)
        if self.hashes.isdisjoint(map(self.gram_hash, gram_sequence(tokens, self.size))):
            return
        self.matched.update(gram for gram in gram_sequence(tokens, self.size) if self.gram_hash(gram) in self.hashes)

    def overlaps(self) -> list[PromptOverlap]:
        """Per held-out prompt of at least `size` words, the share of its distinct n-grams seen in training."""
        found = []
        for prompt in self.prompts:
            grams = ngrams(prompt.tokens, self.size)
            if not grams:
                continue
            shared = sum(gram in self.matched for gram in grams)
            found.append(PromptOverlap(prompt.id, prompt.turn, prompt.source, len(grams), shared / len(grams)))
        return found


def prompt_overlaps(held_out: Iterable[PromptRecord], train: Iterable[PromptRecord],
                    size: int = DEFAULT_NGRAM, gram_hash: GramHash = hash) -> list[PromptOverlap]:
    """Per user turn of each held-out record, the share of its n-grams that the training records contain; the
    training records are read once, one message at a time (a generator keeps them out of memory)."""
    index = HeldOutIndex(held_out, size, gram_hash)
    for record in train:
        for text in record_texts(record):
            index.scan(text or "")
    return index.overlaps()


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
