"""Word n-gram overlap of held-out prompts with the training records (tasks/data/contamination.py)."""

from __future__ import annotations

import pytest

from contract.records import Message, PromptRecord, Provenance
from tasks.data.contamination import contamination_summary, ngrams, prompt_overlaps, words

QUESTION = "Describe five key principles in evaluating an argument in analytical writing and explain each one briefly."


def record(rid: str, *turns: tuple[str, str], source: str = "chats") -> PromptRecord:
    return PromptRecord(id=rid, source=source, messages=[Message(role=role, content=text) for role, text in turns],
                        provenance=Provenance(file="x.jsonl", line=1, format="openai", original_id=rid))


def test_words_ignore_case_and_punctuation_and_short_texts_have_no_ngrams() -> None:
    assert words("Hello, WORLD!  it's 2 o'clock") == ["hello", "world", "it", "s", "2", "o", "clock"]
    assert ngrams(words("one two three"), 2) == {("one", "two"), ("two", "three")}
    assert ngrams(words("too short"), 13) == set()


def test_overlap_is_the_share_of_a_prompts_ngrams_in_any_training_text() -> None:
    half = " ".join(words(QUESTION)[:10])
    train = [record("t1", ("user", f"Please: {QUESTION.upper()}"), ("assistant", "ok")),
             record("t2", ("user", "unrelated"), ("assistant", f"as you said, {half} and more words follow here"))]
    held_out = [record("mt:1", ("user", QUESTION), ("assistant", "..."), ("user", "Now write it as a poem for "
                                                                          "children who love long lists of things")),
                record("mt:2", ("user", "hi"), ("assistant", "hello"), source="mtbench")]
    overlaps = prompt_overlaps(held_out, train, size=13)
    assert [(item.id, item.turn, item.overlap) for item in overlaps] == [("mt:1", 1, 1.0), ("mt:1", 2, 0.0)], \
        "the 2-word prompt is not checked"
    partial = prompt_overlaps(held_out, train[1:], size=5)
    first = next(item for item in partial if item.turn == 1)
    assert first.overlap == pytest.approx(6 / (len(words(QUESTION)) - 4)), "10 shared words hold 6 of its 5-grams"
    summary = contamination_summary(overlaps, 0.5, 13)
    assert summary["contaminated"] == [{"id": "mt:1", "turn": 1, "source": "chats", "overlap": 1.0}]
    assert summary["by_source"]["chats"] == {"prompts": 2, "mean_overlap": 0.5, "max_overlap": 1.0, "contaminated": 1}
