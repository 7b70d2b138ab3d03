"""Word n-gram overlap of held-out prompts with the training records (tasks/data/contamination.py)."""

from __future__ import annotations

import sys
import tracemalloc
from typing import Iterator

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


# --- streaming against the held-out index --------------------------------------------------------------------

def fresh_words(prefix: str, count: int, start: int = 0) -> list[str]:
    """`count` words no other call with another prefix or range produces: overlaps exist only where built."""
    return [f"{prefix}{index}" for index in range(start, start + count)]


def text_record(rid: str, text: str, source: str = "chats") -> PromptRecord:
    return PromptRecord(id=rid, source=source, text=text,
                        provenance=Provenance(file="x.jsonl", line=1, format="text", original_id=rid))


def mixed_corpus() -> tuple[list[PromptRecord], list[PromptRecord], list[tuple[str, int, int, float]]]:
    """Held-out and training records with copies placed by hand, and the expected (id, turn, n-grams, overlap)
    of every checked prompt at n = 13, derived from where the copies were put."""
    copied, clean, partial = fresh_words("a", 40), fresh_words("b", 40), fresh_words("c", 50)
    across_records, across_messages = fresh_words("d", 30), fresh_words("e", 30)
    repeated, short, text_only = fresh_words("f", 13), fresh_words("g", 12), fresh_words("h", 20)
    later_turn, first_turn = fresh_words("i", 25), fresh_words("j", 25)
    filler = iter(range(10**6))

    def pad(tokens: list[str]) -> str:
        return " ".join(fresh_words("t", 7, next(filler) * 7) + tokens + fresh_words("t", 7, next(filler) * 7))

    held_out = [record("mt:copied", ("user", " ".join(copied)), ("assistant", "x"), source="mtbench"),
                record("mt:clean", ("user", " ".join(clean)), source="mtbench"),
                record("gsm:partial", ("user", " ".join(partial)), source="gsm8k"),
                record("gsm:across-records", ("user", " ".join(across_records)), source="gsm8k"),
                record("gsm:across-messages", ("user", " ".join(across_messages)), source="gsm8k"),
                record("mbpp:repeated", ("user", " ".join(repeated + repeated)), source="mbpp"),
                record("mbpp:short", ("user", " ".join(short)), source="mbpp"),
                text_record("alpaca:text", " ".join(text_only), source="alpaca"),
                record("mt:two-turns", ("user", " ".join(first_turn)), ("assistant", "y"),
                       ("user", " ".join(later_turn)), source="mtbench")]
    train = [record("sg:1", ("user", "hello"), ("assistant", pad(copied).upper().replace(" ", ", "))),
             record("sg:2", ("user", pad(partial[:20])), ("assistant", pad(across_records[:15]))),
             record("sg:3", ("user", pad(across_records[15:]))),
             record("sg:4", ("user", pad(across_messages[:15])), ("assistant", pad(across_messages[15:]))),
             record("sg:5", ("system", pad(repeated)), ("user", pad(short))),
             text_record("uc:1", pad(text_only) + " " + pad(later_turn)),
             record("uc:2", ("user", pad(fresh_words("t", 300, 10**7))))]
    expected = [("mt:copied", 1, 28, 1.0), ("mt:clean", 1, 28, 0.0), ("gsm:partial", 1, 38, 8 / 38),
                ("gsm:across-records", 1, 18, 6 / 18), ("gsm:across-messages", 1, 18, 6 / 18),
                ("mbpp:repeated", 1, 13, 1 / 13), ("alpaca:text", 1, 8, 1.0), ("mt:two-turns", 1, 13, 0.0),
                ("mt:two-turns", 2, 13, 1.0)]
    return held_out, train, expected


@pytest.mark.parametrize("gram_hash", [hash, lambda gram: 0, lambda gram: len(gram[6]) % 3],
                         ids=["python-hash", "every-ngram-collides", "three-buckets"])
def test_streamed_overlaps_are_the_flags_built_into_a_mixed_corpus_whatever_the_hash_collides(gram_hash) -> None:
    held_out, train, expected = mixed_corpus()
    overlaps = prompt_overlaps(held_out, iter(train), size=13, gram_hash=gram_hash)
    assert [(item.id, item.turn, item.ngrams, item.overlap) for item in overlaps] == expected, \
        "n-grams do not span messages or records, repeats count once, a collision neither adds nor drops one"
    summary = contamination_summary(overlaps, 0.5, 13)
    assert [(item["id"], item["turn"]) for item in summary["contaminated"]] == \
        [("mt:copied", 1), ("alpaca:text", 1), ("mt:two-turns", 2)]
    assert summary["by_source"]["mtbench"] == {"prompts": 4, "mean_overlap": 0.5, "max_overlap": 1.0,
                                               "contaminated": 2}
    assert summary["by_source"]["gsm8k"]["max_overlap"] == pytest.approx(6 / 18)


def test_training_text_streams_past_the_index_so_memory_is_bounded_by_the_held_out_side() -> None:
    records, words_each, size = 200, 300, 13
    pasted = fresh_words("p", 20)
    held_out = [record("mt:pasted", ("user", " ".join(pasted))),
                record("mt:clean", ("user", " ".join(fresh_words("q", 20))))]

    def train() -> Iterator[PromptRecord]:
        for index in range(records):
            tokens = fresh_words(f"r{index}x", words_each) + (pasted if index == records - 1 else [])
            yield record(f"sg:{index}", ("user", " ".join(tokens)))

    next(train())  # the record model's first build (validator caches) is not the check's memory
    tracemalloc.start()
    overlaps = prompt_overlaps(held_out, train(), size)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [(item.id, item.overlap) for item in overlaps] == [("mt:pasted", 1.0), ("mt:clean", 0.0)]
    distinct_training_ngrams = records * (words_each - size + 1)
    one_tuple = sys.getsizeof(tuple(range(size)))
    assert peak < distinct_training_ngrams * one_tuple / 10, \
        f"peak {peak} B: a tenth of the {distinct_training_ngrams} training n-gram tuples would be held at once"
