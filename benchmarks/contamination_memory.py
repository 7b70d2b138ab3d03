"""Decontamination at the GPU recipe's size: peak RSS and time of the streamed check against the set it replaced.

    .venv/bin/python benchmarks/contamination_memory.py [--conversations 300000] [--held-out 3000]
        [--approaches generate,baseline,streamed] [--rss-cap-gib 4] [--seed 0]

Synthetic chat text stands in for ShareGPT + UltraChat (~300k conversations): 3-6 messages of 100-300 words
(~200 on average) drawn from a Zipf-like law over a 30,000-word vocabulary, and `--held-out` prompts of 20-150
words from the same law; one conversation in 500 has a held-out prompt pasted into its first message, one in 1,000
the first half of one. Each approach runs in a fresh child process fed by the same seeded generator (the training
records never sit in a list), so its ru_maxrss is its own:

- `generate`: only builds and drops the records: the floor both others pay.
- `baseline`: the algorithm before streaming (HEAD up to 2026-12-07), re-expressed here: one set of every
  training message's n-grams, then each held-out prompt's n-grams looked up in it.
- `streamed`: tasks/data/contamination.py: the held-out n-grams' hashes indexed, the training text streamed past.

A child stops once its RSS passes `--rss-cap-gib` (checked every 500 conversations) and says so: the baseline's set
grows with the training text, so it is measured at a smaller N and extrapolated linearly (labelled as such). When
both finish, their overlaps are compared and must be identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from operator import itemgetter
from typing import Iterable, Iterator

import numpy as np

from contract.records import Message, PromptRecord, Provenance
from tasks.data.contamination import DEFAULT_NGRAM, PromptOverlap, ngrams, prompt_overlaps, prompt_turns, \
    record_texts, words

VOCABULARY = 30_000
PASTE_EVERY, HALF_PASTE_EVERY, RSS_CHECK_EVERY = 500, 1_000, 500
MIB = 1 << 20
RECIPE = 300_000  # conversations of the GPU recipe (ShareGPT + UltraChat)


class RssCapExceeded(RuntimeError):
    """The child's resident memory passed the cap: the run stops rather than crowd the shared machine."""


def vocabulary(rng: np.random.Generator) -> list[str]:
    """Distinct pseudo-words of 2-12 letters (duplicates from the draw dropped, order kept)."""
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    found: dict[str, None] = {}
    while len(found) < VOCABULARY:
        length = int(rng.integers(2, 13))
        found.setdefault("".join(letters[rng.integers(0, 26, size=length)]), None)
    return list(found)


class SyntheticCorpus:
    """Seeded held-out prompts and a generator of training conversations: the same text in every child."""

    def __init__(self, seed: int, held_out: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab = vocabulary(self.rng)
        weights = 1.0 / (np.arange(VOCABULARY) + 2.7)
        self.cdf = np.cumsum(weights / weights.sum())
        self.held_out = [self.record(f"eval:{index}", "eval", [self.text(int(self.rng.integers(20, 151)))])
                         for index in range(held_out)]

    def text(self, count: int) -> str:
        indices = np.searchsorted(self.cdf, self.rng.random(count)).clip(max=VOCABULARY - 1)
        return " ".join(itemgetter(*indices.tolist())(self.vocab)) if count > 1 else self.vocab[int(indices[0])]

    def record(self, rid: str, source: str, texts: list[str]) -> PromptRecord:
        roles = ["user" if turn % 2 == 0 else "assistant" for turn in range(len(texts))]
        return PromptRecord(id=rid, source=source, messages=[Message(role=role, content=text)
                                                             for role, text in zip(roles, texts)],
                            provenance=Provenance(file="synthetic.jsonl", line=1, format="openai", original_id=rid))

    def pasted(self, conversation: int) -> str:
        """The held-out text (whole or half) this conversation carries, or ''."""
        if conversation % PASTE_EVERY == 0:
            prompt = self.held_out[(conversation // PASTE_EVERY) % len(self.held_out)]
            return prompt.messages[0].content or ""
        if conversation % HALF_PASTE_EVERY == HALF_PASTE_EVERY // 2:
            prompt = self.held_out[-1 - (conversation // HALF_PASTE_EVERY) % len(self.held_out)]
            tokens = (prompt.messages[0].content or "").split()
            return " ".join(tokens[:len(tokens) // 2])
        return ""

    def train(self, conversations: int) -> Iterator[PromptRecord]:
        for conversation in range(conversations):
            lengths = self.rng.integers(100, 301, size=int(self.rng.integers(3, 7))).tolist()
            texts = [self.text(length) for length in lengths]
            texts[0] = f"{texts[0]} {self.pasted(conversation)}"
            yield self.record(f"train:{conversation}", "train", texts)


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def capped(records: Iterable[PromptRecord], cap_bytes: int, progress: list[int]) -> Iterator[PromptRecord]:
    """The records, counting them into `progress`; raises once the process's RSS passes the cap."""
    for index, item in enumerate(records):
        if index % RSS_CHECK_EVERY == 0 and rss_bytes() > cap_bytes:
            raise RssCapExceeded(f"RSS {rss_bytes() / MIB:.0f} MiB over the cap after {index} conversations")
        progress[0] = index + 1
        yield item


def baseline_overlaps(held_out: list[PromptRecord], train: Iterable[PromptRecord], size: int) -> list[PromptOverlap]:
    """BASELINE, the check before streaming, re-expressed: a set of every training n-gram, then the lookups."""
    seen: set[tuple[str, ...]] = set()
    for item in train:
        for text in record_texts(item):
            seen |= ngrams(words(text), size)
    overlaps = []
    for item in held_out:
        for turn, text in enumerate(prompt_turns(item), start=1):
            grams = ngrams(words(text), size)
            if grams:
                shared = sum(gram in seen for gram in grams)
                overlaps.append(PromptOverlap(item.id, turn, item.source, len(grams), shared / len(grams)))
    return overlaps


def run_child(approach: str, args: argparse.Namespace) -> dict[str, object]:
    """One approach over the corpus in this process: seconds, peak RSS before and after, overlaps' digest."""
    corpus = SyntheticCorpus(args.seed, args.held_out)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    progress = [0]
    train = capped(corpus.train(args.conversations), int(args.rss_cap_gib * (1 << 30)), progress)
    started = time.perf_counter()
    overlaps: list[PromptOverlap] = []
    error = None
    try:
        if approach == "generate":
            for _ in train:
                pass
        elif approach == "baseline":
            overlaps = baseline_overlaps(corpus.held_out, train, DEFAULT_NGRAM)
        else:
            overlaps = prompt_overlaps(corpus.held_out, train, DEFAULT_NGRAM)
    except RssCapExceeded as exceeded:
        error = str(exceeded)
    seconds = time.perf_counter() - started
    digest = hashlib.sha256(repr(overlaps).encode()).hexdigest()[:16] if overlaps else None
    return {"approach": approach, "conversations": progress[0], "seconds": seconds, "rss_before": rss_before,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "stopped": error,
            "digest": digest, "contaminated": sum(overlap.overlap >= 0.5 for overlap in overlaps),
            "prompts": len(overlaps)}


def spawn(approach: str, args: argparse.Namespace) -> dict[str, object]:
    command = [sys.executable, __file__, "--child", approach, "--conversations", str(args.conversations),
               "--held-out", str(args.held_out), "--rss-cap-gib", str(args.rss_cap_gib), "--seed", str(args.seed)]
    finished = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(finished.stdout.strip().splitlines()[-1])


def report(results: dict[str, dict[str, object]]) -> None:
    """The table, the ratios of this run and, for a stopped or smaller baseline, its linear extrapolation."""
    floor = results.get("generate")
    print(f"{'approach':<10} {'convs':>8} {'seconds':>9} {'net s':>8} {'peak MiB':>9} {'+MiB':>8}  result")
    for name, result in results.items():
        net = result["seconds"] - floor["seconds"] * result["conversations"] / max(floor["conversations"], 1) \
            if floor and name != "generate" else result["seconds"]
        grown = (result["peak_rss"] - result["rss_before"]) / MIB
        outcome = result["stopped"] or ("records built and dropped" if name == "generate" else
                                        f"{result['prompts']} prompts, {result['contaminated']} contaminated, "
                                        f"digest {result['digest']}")
        print(f"{name:<10} {result['conversations']:>8} {result['seconds']:>9.1f} {net:>8.1f} "
              f"{result['peak_rss'] / MIB:>9.0f} {grown:>8.0f}  {outcome}")
        result["net"], result["grown"] = net, grown
    base, streamed = results.get("baseline"), results.get("streamed")
    if base and streamed and not base["stopped"] and not streamed["stopped"]:
        assert base["digest"] == streamed["digest"], "the streamed check must give the baseline's overlaps"
        print(f"same overlaps: yes; baseline/streamed: peak RSS {base['peak_rss'] / streamed['peak_rss']:.1f}x, "
              f"RSS growth {base['grown'] / max(streamed['grown'], 1):.1f}x, net time "
              f"{base['net'] / streamed['net']:.2f}x")
    if base and base["conversations"]:
        per_conversation = base["grown"] * MIB / base["conversations"]
        print(f"baseline extrapolated linearly from {base['conversations']:,} conversations (not measured): "
              f"{per_conversation / 1024:.0f} KiB/conversation -> {per_conversation * RECIPE / (1 << 30):.0f} GiB "
              f"at {RECIPE:,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=RECIPE)
    parser.add_argument("--approaches", default="generate,baseline,streamed")
    parser.add_argument("--held-out", type=int, default=3_000)
    parser.add_argument("--rss-cap-gib", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=["generate", "baseline", "streamed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args)))
        return
    results = {approach: spawn(approach, args) for approach in args.approaches.split(",")}
    report(results)


if __name__ == "__main__":
    main()
