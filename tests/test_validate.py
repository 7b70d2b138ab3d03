"""validate stage: real GX validations over hand-built regenerated records, and the leak-free train/eval split."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Optional

import pytest

from contract.config import RunConfig
from contract.records import GenerationParams, Message, Outcome, PromptRecord, Provenance, StageReport, TurnGeneration
from tasks import target
from tasks.data import split as data_split

TEXT_RECORD = "<|im_start|>user\nWhat is the capital of France<|im_end|>\n<|im_start|>assistant\nParis<|im_end|>\n"


# --- building inputs ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def materialised(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path) -> Path:
    """The target stage run once for this module: `<dir>/target/` and `<dir>/target.json`."""
    base = tmp_path_factory.mktemp("validate-target")
    target.run(RunConfig.model_validate({"output_dir": str(base), "model": {"source": "local", "path": str(tiny_target_dir)}}))
    return base


@pytest.fixture(scope="module")
def chat_hash(materialised: Path) -> str:
    return json.loads((materialised / "target.json").read_text())["chat_template_hash"]


def user(text: str) -> Message:
    return Message(role="user", content=text)


def system(text: str) -> Message:
    return Message(role="system", content=text)


def bot(text: Optional[str], supervised: bool = True, reasoning: Optional[str] = None) -> Message:
    return Message(role="assistant", content=text, supervised=supervised, reasoning_content=reasoning)


def generation(template_hash: Optional[str], reasoning: str = "off") -> GenerationParams:
    return GenerationParams(backend="local", model_id="tiny", model_revision="rev", template_hash=template_hash,
                            temperature=0.0, top_p=1.0, max_new_tokens=32, seed=0, reasoning=reasoning,
                            stop_tokens=["<|im_end|>"])


def conv(chat_hash: Optional[str], rid: str, *messages: Message, split: str = "auto", original_id: Optional[str] = None,
         with_generation: bool = True) -> PromptRecord:
    return PromptRecord(
        id=f"chats:{rid}", source="chats", messages=list(messages), split=split,
        provenance=Provenance(file="chats.jsonl", line=1, format="openai", original_id=original_id or rid),
        generation=generation(chat_hash) if with_generation else None,
    )


def text_record(rid: str, text: str = TEXT_RECORD) -> PromptRecord:
    return PromptRecord(id=f"texts:{rid}", source="texts", text=text,
                        provenance=Provenance(file="texts.jsonl", line=1, format="text", original_id=rid))


def clean_records(chat_hash: str) -> list[PromptRecord]:
    return [
        conv(chat_hash, "hello", user("Hello, how are you?"), bot("I am fine, thank you.")),
        conv(chat_hash, "france", system("You are brief."), user("What is the capital of France?"), bot("Paris.")),
        conv(chat_hash, "story", user("Tell me a story about a bird."), bot("A small bird learns to fly.", supervised=False),
             user("Make it shorter."), bot("A bird flew.")),
        conv(chat_hash, "code", user("Write a Python function that adds two numbers."), bot("def add(a, b): return a + b")),
        conv(chat_hash, "fox", user("The quick brown fox?"), bot("It jumps over the lazy dog.")),
        conv(chat_hash, "mt-81", user("Compose an engaging travel blog post about Hawaii."), bot("Aloha from the islands!"),
             split="eval"),
        text_record("pretemplated"),
    ]


def write_upstream_reports(data_dir: Path, count: int) -> None:
    """The reports of an ingest and a regenerate that passed `count` records on without an error (the error
    budget reads them)."""
    for stage in ("ingest", "regenerate"):
        outcomes = [Outcome(key=f"{stage}:{number}", status="ok") for number in range(1, count + 1)]
        report = StageReport.from_outcomes(stage, outcomes, {outcome.key: "chats" for outcome in outcomes})
        (data_dir / f"{stage}_report.json").write_text(report.model_dump_json())


def prepare(tmp_path: Path, materialised: Path, items: list, **validation) -> RunConfig:
    """An output dir holding the materialised target, a regenerated.jsonl of `items` (records or raw lines) and
    error-free upstream reports."""
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "target").symlink_to(materialised / "target", target_is_directory=True)
    shutil.copy(materialised / "target.json", out / "target.json")
    lines = [item if isinstance(item, str) else item.model_dump_json(exclude_none=True) for item in items]
    (out / "data" / "regenerated.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    write_upstream_reports(out / "data", len(items))
    regeneration = validation.pop("regeneration", {})
    data = validation.pop("data", {})
    return RunConfig.model_validate({"output_dir": str(out), "validation": validation, "regeneration": regeneration,
                                     "data": data, "model": {"source": "local", "path": str(materialised / "target")}})


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def contract_of(cfg: RunConfig) -> dict:
    return json.loads((cfg.output_path / "reports" / "data_contract.json").read_text())


def contract_of_dir(tmp_path: Path) -> dict:
    """The data contract of the run prepare() set up under `tmp_path`."""
    return json.loads((tmp_path / "out" / "reports" / "data_contract.json").read_text())


def expectation(contract: dict, name: str) -> dict:
    (entry,) = [entry for entry in contract["expectations"] if entry["name"] == name]
    return entry


def outcomes_by_id(cfg: RunConfig) -> dict[str, dict]:
    report = json.loads((cfg.output_path / "data" / "validate_report.json").read_text())
    return {outcome.get("id") or outcome["key"]: outcome for outcome in report["outcomes"]}


# --- clean data ---------------------------------------------------------------------------------------------

def test_clean_data_passes_every_expectation_and_writes_everything(tmp_path: Path, materialised: Path, chat_hash: str) -> None:
    from tasks import validate

    records = clean_records(chat_hash)
    cfg = prepare(tmp_path, materialised, records)
    result = validate.run(cfg)

    contract = contract_of(cfg)
    failed = [entry["name"] for entry in contract["expectations"] if not entry["passed"]]
    assert failed == [] and contract["passed"] and contract["violations"] == []
    names = {entry["name"] for entry in contract["expectations"]}
    assert {"role_order", "unique_ids", "template_hash_matches", "supervised_tokens_after_truncation",
            "conversation_in_one_split", "prompt_in_one_split"} <= names
    role_order = expectation(contract, "role_order")
    assert role_order["not_applicable"] == 1 and "pre-templated" in role_order["note"]

    out = cfg.output_path
    train, evaluation = read_jsonl(out / "data" / "train.jsonl"), read_jsonl(out / "data" / "eval.jsonl")
    assert sorted(row["id"] for row in train + evaluation) == sorted(record.id for record in records)
    assert "chats:mt-81" in {row["id"] for row in evaluation}, "an eval-only record stays in eval"
    assert PromptRecord.model_validate(train[0]).generation is not None or train[0]["id"].startswith("texts:")
    index = out / "reports" / "data_docs" / "index.html"
    assert index.is_file() and "eaglet_regenerated_records" in index.read_text()
    assert list((out / "reports" / "data_docs" / "validations").rglob("*.html")), "validation result pages"

    totals = contract["totals"]
    assert (totals["input"], totals["ok"], totals["error"], totals["skipped"]) == (7, 7, 0, 0)
    assert (totals["train"], totals["eval"]) == (len(train), len(evaluation))
    assert totals["supervised_tokens"]["total"] == result.supervised_tokens > 0
    summary = result.summary()
    assert summary == {"input": 7, "ok": 7, "error": 0, "skipped": 0, "train": len(train), "eval": len(evaluation),
                       "supervised_tokens": result.supervised_tokens}
    report = json.loads((out / "data" / "validate_report.json").read_text())
    assert [outcome["key"] for outcome in report["outcomes"]] == [f"regenerated.jsonl:{n}" for n in range(1, 8)]
    assert {outcome["status"] for outcome in report["outcomes"]} == {"ok"}
    assert result.reports() == [out / "reports" / "data_contract.json", out / "data" / "validate_report.json"]
    assert not list(out.rglob(".*tmp")), "no temp files or directories left behind"


# --- planted violations, all in one run ---------------------------------------------------------------------

PLANTED = [
    # (record id or line key, expectation that must catch it, outcome status)
    ("chats:user-user", "role_order", "error"),
    ("chats:starts-with-assistant", "role_order", "error"),
    ("chats:ends-unsupervised", "role_order", "error"),
    ("chats:ends-with-user", "role_order", "error"),
    ("chats:blank-answer", "assistant_targets_non_blank", "error"),
    ("chats:empty-answer", "assistant_targets_non_blank", "error"),
    ("chats:think-in-answer", "no_reasoning_markers", "error"),
    ("chats:think-in-prompt", "no_reasoning_markers", "error"),
    ("chats:reasoning-when-off", "reasoning_content_allowed", "error"),
    ("chats:other-template", "template_hash_matches", "error"),
    ("chats:no-generation", "template_hash_matches", "error"),
    ("chats:no-content", "template_renders", "error"),
    ("chats:twice", "unique_ids", "error"),
    ("chats:too-long", "supervised_tokens_after_truncation", "skipped"),
    ("regenerated.jsonl:23", "record_parses", "error"),
    ("regenerated.jsonl:24", "record_parses", "error"),
    ("regenerated.jsonl:25", "record_parses", "error"),
]


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory: pytest.TempPathFactory, materialised: Path, chat_hash: str) -> RunConfig:
    from tasks import validate

    h = chat_hash
    items = clean_records(h) + [
        conv(h, "user-user", user("Hi"), user("Hello?"), bot("Hello.")),
        conv(h, "starts-with-assistant", bot("Welcome."), user("Hi"), bot("Hello.")),
        conv(h, "ends-unsupervised", user("Hi"), bot("Hello.", supervised=False)),
        conv(h, "ends-with-user", user("Hi"), bot("Hello."), user("Bye")),
        conv(h, "blank-answer", user("Say something."), bot("  \n\t ")),
        conv(h, "empty-answer", user("Say nothing."), bot("")),
        conv(h, "think-in-answer", user("Capital of France?"), bot("<think>easy</think>Paris.")),
        conv(h, "think-in-prompt", user("What does </think> mean?"), bot("It closes a tag.")),
        conv(h, "reasoning-when-off", user("Capital of Italy?"), bot("Rome.", reasoning="It is Rome.")),
        conv(h, "other-template", user("Capital of Spain?"), bot("Madrid.")).model_copy(
            update={"generation": generation("0" * 64)}),
        conv(h, "no-generation", user("Capital of Peru?"), bot("Lima."), with_generation=False),
        conv(h, "no-content", user("Capital of Chile?"), bot(None)),
    ]
    twice = conv(h, "twice", user("Capital of Japan?"), bot("Tokyo."))
    items += [twice, twice.model_copy(update={"messages": [user("Capital of Korea?"), bot("Seoul.")]})]
    items += [conv(h, "too-long", user("tell me " * 60 + "a story"), bot("Once upon a time."))]
    items += ['{"id": "broken", "messages": [', '{"id": "no-provenance", "source": "chats", "text": "hi"}', "   "]
    assert len(items) == 25, "PLANTED names lines 23-25"
    cfg = prepare(tmp_path_factory.mktemp("planted"), materialised, items, max_error_fraction=1.0, max_length=96)
    validate.run(cfg)
    return cfg


@pytest.mark.parametrize("label,name,status", PLANTED, ids=[f"{name}:{label}" for label, name, _ in PLANTED])
def test_each_expectation_catches_its_planted_violation(planted_run: RunConfig, label: str, name: str, status: str) -> None:
    contract = contract_of(planted_run)
    entry = expectation(contract, name)
    assert not entry["passed"]
    assert label in entry["sample_ids"], f"{name} names {label} in data_contract.json"
    outcome = outcomes_by_id(planted_run)[label]
    assert outcome["status"] == status
    assert name in outcome["reason"]


def test_planted_run_keeps_clean_records_and_balances(planted_run: RunConfig, chat_hash: str) -> None:
    outcomes = outcomes_by_id(planted_run)
    clean = [record.id for record in clean_records(chat_hash)]
    assert all(outcomes[rid]["status"] == "ok" for rid in clean), "no false positives"
    totals = contract_of(planted_run)["totals"]
    assert totals["input"] == 25 and totals["ok"] + totals["error"] + totals["skipped"] == 25
    assert (totals["ok"], totals["skipped"]) == (len(clean), 1)
    kept = read_jsonl(planted_run.output_path / "data" / "train.jsonl") + read_jsonl(planted_run.output_path / "data" / "eval.jsonl")
    assert sorted(row["id"] for row in kept) == sorted(clean)
    twice = [outcome for outcome in json.loads((planted_run.output_path / "data" / "validate_report.json").read_text())["outcomes"]
             if outcome.get("id") == "chats:twice"]
    assert len(twice) == 2 and all("also on line" in outcome["reason"] for outcome in twice)
    too_long = outcomes["chats:too-long"]["reason"]
    assert "max_length 96" in too_long and too_long.startswith("supervised_tokens_after_truncation")


def test_a_tokenizer_that_does_not_round_trip_is_caught(tmp_path: Path, materialised: Path, chat_hash: str) -> None:
    """A target whose tokenizer normalises text (NFKC) cannot give back the rendered text of a ligature."""
    from tasks import validate

    normalising = tmp_path / "normalising"
    shutil.copytree(materialised, normalising, symlinks=False)
    tokenizer_json = normalising / "target" / "tokenizer.json"
    spec = json.loads(tokenizer_json.read_text())
    spec["normalizer"] = {"type": "NFKC"}
    tokenizer_json.write_text(json.dumps(spec))
    records = [conv(chat_hash, "plain", user("Hello"), bot("Fine.")),
               conv(chat_hash, "ligature", user("Define \ufb01ne."), bot("Good."))]
    cfg = prepare(tmp_path, normalising, records, max_error_fraction=1.0)
    validate.run(cfg)
    entry = expectation(contract_of(cfg), "tokens_roundtrip")
    assert not entry["passed"] and entry["sample_ids"] == ["chats:ligature"]
    outcomes = outcomes_by_id(cfg)
    assert outcomes["chats:plain"]["status"] == "ok"
    assert outcomes["chats:ligature"]["reason"].startswith("tokens_roundtrip: decoding its")


def test_reasoning_content_is_allowed_when_saved(tmp_path: Path, materialised: Path, chat_hash: str) -> None:
    from tasks import validate

    records = [conv(chat_hash, "thought", user("Capital of Italy?"), bot("Rome.", reasoning="Italy's capital is Rome.")),
               conv(chat_hash, "raw-think", user("Capital of Spain?"), bot("<think>hmm</think>Madrid.")),
               # ChatML keeps the first turn's reasoning in the history; the served history never had it
               conv(chat_hash, "reasoning-in-history", user("Capital of France?"), bot("Paris.", reasoning="easy"),
                    user("And of Italy?"), bot("Rome."))]
    cfg = prepare(tmp_path, materialised, records, max_error_fraction=1.0, eval_fraction=0.0,
                  regeneration={"reasoning": "save"})  # the one ok record stays in train (an empty one fails)
    result = validate.run(cfg)
    outcomes = outcomes_by_id(cfg)
    assert outcomes["chats:thought"]["status"] == "ok"
    assert outcomes["chats:raw-think"]["status"] == "error" and "no_reasoning_markers" in outcomes["chats:raw-think"]["reason"]
    history = outcomes["chats:reasoning-in-history"]
    assert history["status"] == "error" and history["reason"].startswith(
        "serving_prompts_match: turn 3: the training prompt differs from what the engine renders for the served "
        "messages at character"), history
    assert "ours '<think>easy</think>Paris." in history["reason"] and "engine's 'Paris." in history["reason"]
    kept = read_jsonl(result.train_path) + read_jsonl(result.eval_path)
    assert [row["messages"][1]["reasoning_content"] for row in kept] == ["Italy's capital is Rome."]


def test_unicode_line_separators_inside_a_record_do_not_split_it(tmp_path: Path, materialised: Path,
                                                                  chat_hash: str) -> None:
    """JSON keeps U+2028 / U+2029 / U+0085 raw inside strings (ShareGPT V3 has them): one record, not several."""
    from tasks import validate

    records = [conv(chat_hash, "separators", user("Line one\u2028line two\u2029and\x85three?"), bot("Yes\u2028no.")),
               *clean_records(chat_hash)[:2]]
    cfg = prepare(tmp_path, materialised, records)
    assert "\u2028" in (cfg.output_path / "data" / "regenerated.jsonl").read_text(encoding="utf-8")
    result = validate.run(cfg)
    assert result.report.input == 3 and result.report.ok == 3, result.report
    assert outcomes_by_id(cfg)["chats:separators"]["status"] == "ok"


# --- hard failure -------------------------------------------------------------------------------------------

def test_error_fraction_above_threshold_raises_after_writing_reports(tmp_path: Path, materialised: Path, chat_hash: str) -> None:
    from tasks import validate

    records = clean_records(chat_hash) + [conv(chat_hash, "user-user", user("Hi"), user("Hi?"), bot("Hello.")),
                                          conv(chat_hash, "blank", user("Hi"), bot(" "))]
    cfg = prepare(tmp_path, materialised, records)  # max_error_fraction defaults to 0
    stale = cfg.output_path / "data" / "train.jsonl"
    stale.write_text('{"stale": true}\n')
    with pytest.raises(validate.DataContractError) as raised:
        validate.run(cfg)
    message = str(raised.value)
    assert "max_error_fraction" in message
    assert "role_order (1 failing, e.g. chats:user-user)" in message
    assert "assistant_targets_non_blank (1 failing, e.g. chats:blank)" in message
    contract = contract_of(cfg)
    assert contract["passed"] is False and contract["totals"]["error"] == 2
    assert "chats:user-user" in expectation(contract, "role_order")["sample_ids"]
    assert outcomes_by_id(cfg)["chats:blank"]["status"] == "error"
    assert (cfg.output_path / "reports" / "data_docs" / "index.html").is_file()
    assert not stale.exists() and not (cfg.output_path / "data" / "eval.jsonl").exists(), "no train/eval beside a failed contract"


def write_chats(path: Path) -> Path:
    """Eleven input lines: eight clean conversations, one broken line (ingest's error), one that opens with an
    answer (regenerate's error: nothing to regenerate it from) and a copy of the first (skipped by ingest: a
    duplicate never enters the pipeline, so it is not part of the input)."""
    clean = [{"id": f"q{n}", "messages": [{"role": "user", "content": f"What is {n} plus {n}?"},
                                          {"role": "assistant", "content": f"It is {2 * n}."}]} for n in range(8)]
    answer_first = {"id": "answer-first", "messages": [{"role": "assistant", "content": "Welcome."},
                                                       {"role": "user", "content": "Hello?"}]}
    lines = [json.dumps(item) for item in clean] + ['{"id": "broken", "messages": [', json.dumps(answer_first),
                                                     json.dumps(clean[0])]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def run_through_validate(tmp_path: Path, materialised: Path, max_error_fraction: float) -> RunConfig:
    """ingest -> regenerate (the source's answers kept) -> validate over write_chats."""
    from tasks import ingest, regenerate, validate

    chats = tmp_path / "chats.jsonl"
    cfg = prepare(tmp_path, materialised, [], max_error_fraction=max_error_fraction,
                  regeneration={"enabled": False}, data={"sources": [{"name": "chats", "path": str(chats)}]})
    write_chats(chats)
    ingest.run(cfg)
    regenerate.run(cfg)
    validate.run(cfg)
    return cfg


def test_the_error_budget_counts_ingest_and_regenerate_errors_of_the_input(tmp_path: Path, materialised: Path) -> None:
    """Two of ten input lines never reach validate; over validate's eight survivors the run would look clean."""
    from tasks import validate

    with pytest.raises(validate.DataContractError) as raised:
        run_through_validate(tmp_path / "strict", materialised, max_error_fraction=0.1)
    message = str(raised.value)
    assert "error fraction 2/10 = 0.2000 of the pipeline's input (ingest ok + error) exceeds " \
           "validation.max_error_fraction 0.1 (errors: ingest 1, regenerate 1, validate 0)" in message
    assert "ingest: 1 error(s), e.g.\n    chats/" in message and "chats.jsonl:9: " in message
    assert ("regenerate: 1 error(s), e.g.\n    chats:answer-first: an assistant turn comes before the first user "
            "turn") in message
    budget = contract_of_dir(tmp_path / "strict")["error_budget"]
    assert budget["stages"]["ingest"] == {"input": 11, "ok": 9, "error": 1, "skipped": 1}
    assert budget["stages"]["regenerate"] == {"input": 9, "ok": 8, "error": 1, "skipped": 0}
    assert budget["stages"]["validate"] == {"input": 8, "ok": 8, "error": 0, "skipped": 0}
    assert (budget["errors"], budget["pipeline_input"], budget["error_fraction"]) == (2, 10, 0.2)
    assert budget["passed"] is False

    lenient = run_through_validate(tmp_path / "lenient", materialised, max_error_fraction=0.2)
    contract = contract_of(lenient)
    assert contract["passed"] and contract["error_budget"]["passed"]
    assert contract["thresholds"]["error_fraction"] == contract["error_budget"]["error_fraction"] == 0.2
    assert contract["totals"]["train"] + contract["totals"]["eval"] == 8


def test_a_missing_upstream_report_is_named(tmp_path: Path, materialised: Path, chat_hash: str) -> None:
    from tasks import validate

    cfg = prepare(tmp_path, materialised, clean_records(chat_hash)[:2])
    (cfg.output_path / "data" / "regenerate_report.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"regenerate_report\.json: no regenerate report.*run the regenerate"):
        validate.run(cfg)


def test_a_train_split_below_its_floor_fails_naming_the_field(tmp_path: Path, materialised: Path,
                                                              chat_hash: str) -> None:
    from tasks import validate

    records = clean_records(chat_hash)
    few = prepare(tmp_path / "records", materialised, records, min_train_records=100)
    with pytest.raises(validate.DataContractError,
                       match=r"validation\.min_train_records: the train split has [1-7] record\(s\), fewer than 100"):
        validate.run(few)
    assert contract_of(few)["thresholds"]["min_train_records"] == 100
    short = prepare(tmp_path / "tokens", materialised, records, min_supervised_tokens=10**6)
    with pytest.raises(validate.DataContractError) as raised:
        validate.run(short)
    train_tokens = contract_of(short)["totals"]["supervised_tokens"]["train"]
    assert 0 < train_tokens < 10**6
    assert (f"validation.min_supervised_tokens: the train split has {train_tokens} supervised token(s), fewer than "
            f"1000000") in str(raised.value)
    assert "min_train_records" not in str(raised.value)


def test_a_max_length_shorter_than_every_prompt_fails_with_nothing_left(tmp_path: Path, materialised: Path,
                                                                        chat_hash: str) -> None:
    """Every record is skipped (no supervised token within max_length), and skipped records are no errors: the
    error budget alone would pass an empty train split."""
    from tasks import validate

    cfg = prepare(tmp_path, materialised, clean_records(chat_hash), max_length=8)
    with pytest.raises(validate.DataContractError) as raised:
        validate.run(cfg)
    message = str(raised.value)
    assert ("validation.min_train_records: the train split has 0 record(s), fewer than 1 (after truncation to "
            "validation.max_length 8; of 7 input line(s), 7 skipped and 0 error(s))") in message
    assert "validation.min_supervised_tokens: the train split has 0 supervised token(s), fewer than 1" in message
    contract = contract_of(cfg)
    assert contract["error_budget"]["passed"] and not contract["passed"]
    assert (contract["totals"]["skipped"], contract["totals"]["train"]) == (7, 0)
    assert not (cfg.output_path / "data" / "train.jsonl").exists()


def test_per_expectation_threshold_fails_on_skipped_records(tmp_path: Path, materialised: Path, chat_hash: str) -> None:
    from tasks import validate

    records = clean_records(chat_hash) + [conv(chat_hash, "too-long", user("tell me " * 60 + "a story"), bot("Once."))]
    lenient = prepare(tmp_path / "a", materialised, records, max_length=96)
    assert validate.run(lenient).summary()["skipped"] == 1, "skipped records do not count as errors"
    strict = prepare(tmp_path / "b", materialised, records, max_length=96,
                     expectation_thresholds={"supervised_tokens_after_truncation": 0.1})
    with pytest.raises(validate.DataContractError, match=r"supervised_tokens_after_truncation \(1 failing, e\.g\. chats:too-long\)"):
        validate.run(strict)
    assert contract_of(strict)["passed"] is False


def test_unknown_threshold_names_and_empty_input_are_refused(tmp_path: Path, materialised: Path) -> None:
    from tasks import validate

    typo = prepare(tmp_path / "a", materialised, [], expectation_thresholds={"role_ordre": 0.1})
    with pytest.raises(ValueError, match="unknown expectation.*role_ordre.*known: has_records"):
        validate.run(typo)
    empty = prepare(tmp_path / "b", materialised, [])
    with pytest.raises(validate.DataContractError, match="has_records"):
        validate.run(empty)
    assert contract_of(empty)["totals"]["input"] == 0


# --- the split ----------------------------------------------------------------------------------------------

def leak_records(chat_hash: str) -> list[PromptRecord]:
    h = chat_hash
    records = [
        conv(h, "near-1", user("What is the capital of France?"), bot("Paris.")),
        conv(h, "near-2", user("  what is   the CAPITAL\nof france  "), bot("Paris!")),
        conv(h, "near-3", user("What is the capital of France!!!"), bot("It is Paris.")),
        conv(h, "part-0", user("Plan a trip to Rome."), bot("Day one: the Colosseum."), original_id="QWJhYvA_0"),
        conv(h, "part-1", user("Continue the plan."), bot("Day two: the Vatican."), original_id="QWJhYvA_1"),
        conv(h, "mt-81", user("Compose an engaging travel blog post about Hawaii."), bot("Aloha!"), split="eval"),
        conv(h, "blog-copy", user("compose an engaging travel blog post about hawaii"), bot("Mahalo.")),
        conv(h, "blog-train", user("Compose an engaging travel blog post about Hawaii"), bot("Surf."), split="train"),
    ]
    records += [conv(h, f"filler-{n}", user(f"Tell me fact number {n}."), bot(f"Fact {n}.")) for n in range(24)]
    return records + [text_record("france-text")]


def test_split_is_leak_free_on_near_duplicates_conversations_and_eval_only_prompts(
    tmp_path: Path, materialised: Path, chat_hash: str
) -> None:
    from tasks import validate

    cfg = prepare(tmp_path, materialised, leak_records(chat_hash), eval_fraction=0.5, seed=3)
    result = validate.run(cfg)
    split_of = {row["id"]: "train" for row in read_jsonl(result.train_path)}
    split_of.update({row["id"]: "eval" for row in read_jsonl(result.eval_path)})
    assert len(split_of) == 33 and result.train and result.eval, "both splits are used"
    france = {split_of[rid] for rid in ("chats:near-1", "chats:near-2", "chats:near-3", "texts:france-text")}
    assert len(france) == 1, "case/whitespace/punctuation variants and the pre-templated copy share a split"
    assert split_of["chats:part-0"] == split_of["chats:part-1"], "ShareGPT parts of one conversation share a split"
    assert {split_of[rid] for rid in ("chats:mt-81", "chats:blog-copy", "chats:blog-train")} == {"eval"}

    by_split: dict[str, dict[str, set[str]]] = {"train": {"prompt": set(), "conversation": set()},
                                                "eval": {"prompt": set(), "conversation": set()}}
    for path, split in ((result.train_path, "train"), (result.eval_path, "eval")):
        for row in read_jsonl(path):
            record = PromptRecord.model_validate(row)
            prompt = data_split.first_user_prompt(record) or "what is the capital of france"
            by_split[split]["prompt"].add(data_split.normalise_prompt(prompt))
            by_split[split]["conversation"].add(data_split.conversation_id(record))
    assert not by_split["train"]["prompt"] & by_split["eval"]["prompt"]
    assert not by_split["train"]["conversation"] & by_split["eval"]["conversation"]
    contract = contract_of(cfg)
    for name in ("conversation_in_one_split", "prompt_in_one_split", "eval_requests_honoured", "split_is_train_or_eval"):
        assert expectation(contract, name)["passed"], name


def test_split_expectations_catch_a_leaky_split(tmp_path: Path, materialised: Path, chat_hash: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Were the split ever to leak, the GX split suite fails the stage and names the records."""
    from tasks import validate

    def alternating(candidates, eval_fraction, seed):
        return ["train" if index % 2 else "eval" for index in range(len(candidates))]

    monkeypatch.setattr(validate.data_split, "assign_splits", alternating)
    cfg = prepare(tmp_path, materialised, leak_records(chat_hash))
    with pytest.raises(validate.DataContractError) as raised:
        validate.run(cfg)
    message = str(raised.value)
    for name in ("conversation_in_one_split", "prompt_in_one_split", "eval_requests_honoured"):
        assert name in message
    contract = contract_of(cfg)
    assert "chats:near-1" in expectation(contract, "prompt_in_one_split")["sample_ids"]
    assert expectation(contract, "conversation_in_one_split")["sample_ids"][:2] == ["chats:part-0", "chats:part-1"]
    assert "chats:mt-81" in expectation(contract, "eval_requests_honoured")["sample_ids"]


def synthetic(count: int, seed: int = 0) -> list[data_split.SplitCandidate]:
    rng = random.Random(seed)
    return [data_split.SplitCandidate(f"r{n}", f"conv-{n}-{rng.random():.6f}", f"prompt {n} {rng.random():.6f}")
            for n in range(count)]


def test_split_is_deterministic_order_free_and_respects_eval_fraction() -> None:
    items = synthetic(200)
    first = data_split.assign_splits(items, eval_fraction=0.1, seed=7)
    assert first == data_split.assign_splits(items, eval_fraction=0.1, seed=7)
    shuffled = items[:]
    random.Random(1).shuffle(shuffled)
    again = dict(zip((item.id for item in shuffled), data_split.assign_splits(shuffled, 0.1, 7)))
    assert again == dict(zip((item.id for item in items), first)), "record order does not matter"
    assert 0.05 <= first.count("eval") / 200 <= 0.15
    assert data_split.assign_splits(items, 0.1, 8) != first, "the seed matters"
    assert 0.4 <= data_split.assign_splits(items, 0.5, 7).count("eval") / 200 <= 0.6
    assert set(data_split.assign_splits(items, 0.0, 7)) == {"train"}


def test_groups_chain_through_shared_prompts_and_conversations() -> None:
    Candidate = data_split.SplitCandidate
    items = [Candidate("a", "c1", "p1"), Candidate("b", "c1", "p2"), Candidate("c", "c2", "p2"),
             Candidate("d", "c3", "p3", requested="eval"), Candidate("e", "c4", "p3", requested="train"),
             Candidate("f", "c5", "p4", requested="train"), Candidate("g", "c6", "")]
    assert sorted(map(sorted, data_split.groups(items))) == [[0, 1, 2], [3, 4], [5], [6]]
    splits = dict(zip("abcdefg", data_split.assign_splits(items, eval_fraction=0.999, seed=0)))
    assert splits["a"] == splits["b"] == splits["c"]
    assert (splits["d"], splits["e"], splits["f"]) == ("eval", "eval", "train"), "eval wins, then train"
    assert splits["g"] == "eval", "an empty prompt ties nothing together; the hash decides"


def test_prompt_normalisation_and_conversation_ids() -> None:
    assert data_split.normalise_prompt("  What is\tthe CAPITAL of\n France?!  ") == "what is the capital of france"
    assert data_split.normalise_prompt("¿Qué tal?") == "qué tal"
    assert data_split.normalise_prompt("...") == "" and data_split.normalise_prompt(None) == ""

    def record(rid: str, original_id: Optional[str]) -> PromptRecord:
        return PromptRecord(id=rid, source="sharegpt", messages=[user("hi")],
                            provenance=Provenance(file="f", line=1, format="sharegpt", original_id=original_id))

    assert data_split.conversation_id(record("sharegpt:QWJhYvA_1", "QWJhYvA_1")) == "QWJhYvA"
    assert data_split.conversation_id(record("sharegpt:9f2c1a", None)) == "9f2c1a"
    assert data_split.conversation_id(record("sharegpt:HumanEval/0", "HumanEval/0")) == "HumanEval/0"
    assert data_split.conversation_id(record("x:a_1", "a_1"), r"^(?P<conversation>.+)$") == "a_1"


def cut(record: PromptRecord, *turns: int) -> PromptRecord:
    """The record with its assistant turns at `turns` marked as stopped at max_new_tokens (finish reason length)."""
    finished = [TurnGeneration(turn=index, finish_reason="length" if index in turns else "stop", completion_tokens=4)
                for index, message in enumerate(record.messages) if message.role == "assistant"]
    generation = record.generation.model_copy(update={"turns": finished})
    return record.model_copy(update={"generation": generation})


def test_turns_cut_at_max_new_tokens_are_counted_and_dropped_only_when_asked(tmp_path: Path, materialised: Path,
                                                                           chat_hash: str) -> None:
    from tasks import validate

    records = clean_records(chat_hash)
    records[0] = cut(records[0], 1)
    records[2] = cut(records[2], 1, 3)
    kept = prepare(tmp_path / "kept", materialised, records)
    result = validate.run(kept)
    report = json.loads((kept.output_path / "data" / "validate_report.json").read_text())
    assert report["metrics"]["cut_turns"] == 3 and report["metrics"]["records_with_cut_turns"] == 2
    assert result.report.skipped == 0 and expectation(contract_of(kept), "cut_turns_allowed")["passed"]

    dropped = prepare(tmp_path / "dropped", materialised, records, cut_turns="drop")
    result = validate.run(dropped)
    outcomes = outcomes_by_id(dropped)
    assert {key for key, outcome in outcomes.items() if outcome["status"] == "skipped"} == {"chats:hello", "chats:story"}
    assert "cut_turns_allowed" in outcomes["chats:hello"]["reason"]
    assert expectation(contract_of(dropped), "cut_turns_allowed")["unexpected_count"] == 2


# --- decontamination ----------------------------------------------------------------------------------------

BENCHMARK_QUESTION = ("Write a persuasive email to convince your introverted friend, who dislikes public speaking, "
                      "to volunteer as a guest speaker at a local event.")


def contaminated_records(chat_hash: str) -> list[PromptRecord]:
    """Two held-out benchmark questions; one of them pasted into a training conversation, with other words around it."""
    h = chat_hash
    records = clean_records(chat_hash)
    records += [
        conv(h, "mt-82", user(BENCHMARK_QUESTION), bot("Dear friend, ..."), split="eval"),
        conv(h, "pasted", user(f"My teacher asked: {BENCHMARK_QUESTION.upper()} Help me!"), bot("Sure."),
             split="train"),
    ]
    return records


def test_a_benchmark_question_pasted_into_training_fails_the_contract_by_id(tmp_path: Path, materialised: Path,
                                                                           chat_hash: str) -> None:
    from tasks import validate

    cfg = prepare(tmp_path, materialised, contaminated_records(chat_hash), eval_fraction=0.0)
    with pytest.raises(validate.DataContractError, match="held_out_prompts_not_in_training.*chats:mt-82"):
        validate.run(cfg)
    contract = contract_of(cfg)
    check = expectation(contract, "held_out_prompts_not_in_training")
    assert not check["passed"] and check["unexpected_count"] == 1 and check["sample_keys"] == ["chats:mt-82#turn1"]
    report = contract["decontamination"]
    assert report["contaminated"] == [{"id": "chats:mt-82", "turn": 1, "source": "chats", "overlap": 1.0}]
    assert report["ngram_words"] == 13 and report["by_source"]["chats"]["prompts"] == 1, \
        "the Hawaii question has fewer than 13 words: not checked"
    assert not (cfg.output_path / "data" / "train.jsonl").exists()


def test_a_configured_share_of_contaminated_prompts_passes_and_is_still_reported(
        tmp_path: Path, materialised: Path, chat_hash: str) -> None:
    from tasks import validate

    clean = conv(chat_hash, "mt-83", user("Describe five key principles in evaluating an argument in analytical "
                                          "writing, and explain how each one applies to a newspaper editorial."),
                 bot("First, ..."), split="eval")
    cfg = prepare(tmp_path, materialised, [*contaminated_records(chat_hash), clean], eval_fraction=0.0,
                  max_contaminated_share=0.5)
    validate.run(cfg)
    contract = contract_of(cfg)
    assert expectation(contract, "held_out_prompts_not_in_training")["passed"]
    assert [item["id"] for item in contract["decontamination"]["contaminated"]] == ["chats:mt-82"]
