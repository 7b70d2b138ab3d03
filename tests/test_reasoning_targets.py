"""Reasoning targets: a tiny target with a Qwen3-style thinking template (tests/tiny_target.py THINKING_TEMPLATE).

Training must supervise what the target generates at serving time, rendered as serving renders it: the template
variables (`model.chat_template_kwargs`, e.g. enable_thinking) reach every rendering and every server request and
are recorded; a multi-turn reasoning conversation, whose earlier reasoning the template drops from the history,
trains as one sample per turn (counted); the nasty replies each end as a clear error record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from contract.chat_rendering import TemplateError, render_record, render_samples, tokenize_with_mask
from contract.config import RunConfig
from contract.records import Message, PromptRecord
from tasks import capture, regenerate, train, validate
from tasks.features.shards import FeatureSet
from tasks.serving.engine import free_port
from test_regenerate import by_id, openai_run, prepare_run
from chat_server import ChatServer
from tiny_target import build_thinking_target


@pytest.fixture(scope="module")
def thinking_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_thinking_target(tmp_path_factory.mktemp("thinking") / "model")


@pytest.fixture(scope="module")
def thinking_tokenizer(thinking_target: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(thinking_target)


PROVENANCE = {"file": "chats.jsonl", "line": 1, "format": "openai"}


def two_reasoning_turns() -> PromptRecord:
    return PromptRecord(id="chats:multi", source="chats", provenance=PROVENANCE, messages=[
        Message(role="user", content="first question"),
        Message(role="assistant", content="a1", reasoning_content="r1"),
        Message(role="user", content="second question"),
        Message(role="assistant", content="a2", reasoning_content="r2"),
    ])


def supervised_text(tokenizer: Any, rendered) -> str:
    sample = tokenize_with_mask(tokenizer, rendered, 1 << 20)
    return tokenizer.decode([token for token, mask in zip(sample.input_ids, sample.loss_mask) if mask])


def test_a_multi_turn_reasoning_conversation_trains_one_sample_per_turn(thinking_tokenizer: Any) -> None:
    record = two_reasoning_turns()
    with pytest.raises(TemplateError, match="prefix"):
        render_record(thinking_tokenizer, record, "no_end")  # the history drops r1: rendered whole it is wrong
    first, second = render_samples(thinking_tokenizer, record, "no_end")
    assert (first.suffix, second.suffix) == ("#turn1", "#turn3")
    assert supervised_text(thinking_tokenizer, first.rendered) == "<think>r1</think>a1<|im_end|>"
    assert supervised_text(thinking_tokenizer, second.rendered) == "<think>r2</think>a2<|im_end|>"
    assert "r1" not in second.rendered.text and "a1" in second.rendered.text, "the history as the target saw it"
    single = record.model_copy(update={"messages": record.messages[:2]})
    (whole,) = render_samples(thinking_tokenizer, single, "no_end")
    assert whole.suffix == "" and supervised_text(thinking_tokenizer, whole.rendered) == "<think>r1</think>a1<|im_end|>"


def test_template_kwargs_shape_every_rendering_and_are_recorded(thinking_tokenizer: Any) -> None:
    from contract.chat_rendering import bind_template_kwargs

    record = PromptRecord(id="chats:plain", source="chats", provenance=PROVENANCE, messages=[
        Message(role="user", content="question"), Message(role="assistant", content="answer")])
    thinking_off = bind_template_kwargs(thinking_tokenizer.__class__.from_pretrained(thinking_tokenizer.name_or_path),
                                        {"enable_thinking": False})
    rendered = render_record(thinking_off, record, "no_end")
    assert rendered.text.endswith("<|im_start|>assistant\n<think></think>answer<|im_end|>\n")
    assert supervised_text(thinking_off, rendered) == "answer<|im_end|>", "the pre-filled think block is prompt"
    with pytest.raises(TemplateError, match="changes the assistant content"):
        render_record(thinking_tokenizer, record, "no_end")  # thinking on: an answer without its think block


REPLIES = {
    "first question": {"content": "a1", "reasoning_content": "r1"},
    "second question": {"content": "<think>r2</think>a2"},
    "only thinking": {"content": "<think>just thinking</think>"},
    "never closed": {"content": "<think>still thinking"},
    "plain question": {"content": "plain answer", "reasoning_content": "why"},
}
ITEMS = [
    {"id": "multi", "messages": [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "x"},
                                 {"role": "user", "content": "second question"}, {"role": "assistant", "content": "y"}]},
    {"id": "empty-answer", "messages": [{"role": "user", "content": "only thinking"}]},
    {"id": "unclosed", "messages": [{"role": "user", "content": "never closed"}]},
    {"id": "plain", "messages": [{"role": "user", "content": "plain question"}]},
    {"id": "think-in-user", "messages": [{"role": "user", "content": "<think>hm</think> plain question"}]},
]


def test_a_reasoning_server_run_expands_turns_counts_them_and_names_each_bad_reply(
        tmp_path: Path, thinking_target: Path, subprocesses: None) -> None:
    (tmp_path / "script.json").write_text(json.dumps(REPLIES))
    server = ChatServer(thinking_target, free_port(), "--scripted", str(tmp_path / "script.json"))
    try:
        cfg = openai_run(tmp_path, thinking_target, server.url, ITEMS, reasoning="save")
        cfg = cfg.model_copy(update={"validation": cfg.validation.model_copy(update={
            "eval_fraction": 0.0, "max_error_fraction": 0.9, "max_length": 128})})
        cfg.model.chat_template_kwargs = {"enable_thinking": True}
        regenerated = regenerate.run(cfg)
        sent = httpx.get(f"{server.url.rsplit('/v1', 1)[0]}/stats").json()["chat_template_kwargs"]
    finally:
        server.stop()
    assert sent and all(kwargs == {"enable_thinking": True} for kwargs in sent), "every request carries them"
    reasons = {outcome.id: outcome.reason for outcome in regenerated.report.outcomes if outcome.status != "ok"}
    assert "unclosed <think>" in reasons["chats:unclosed"]
    records = by_id(regenerated.output_path)
    multi = records["chats:multi"]
    assert [(m.content, m.reasoning_content) for m in multi.messages if m.role == "assistant"] == [("a1", "r1"), ("a2", "r2")]
    assert multi.generation.chat_template_kwargs == {"enable_thinking": True}

    checked = validate.run(cfg)
    why = {outcome.id: outcome.reason for outcome in checked.report.outcomes if outcome.status == "error"}
    assert "empty" in why["chats:empty-answer"] or "whitespace" in why["chats:empty-answer"], why
    assert "think" in why["chats:think-in-user"] or "reasoning" in why["chats:think-in-user"], why
    assert checked.report.metrics["records_expanded_per_turn"] == 1 and checked.report.metrics["turn_samples"] == 2

    captured = capture.run(cfg)
    ids = {row["id"] for row in FeatureSet(captured.features_dir, "train")}
    assert ids == {"chats:multi#turn1", "chats:multi#turn3", "chats:plain"}
    assert captured.report.metrics["records_expanded_per_turn"] == 1 and captured.report.metrics["turn_samples"] == 2

    other = cfg.model_copy(update={"model": cfg.model.model_copy(update={"chat_template_kwargs": {}})})
    with pytest.raises(validate.DataContractError) as refused:
        validate.run(other)  # records generated under other template variables are not this run's
    assert ('chats:multi: template_hash_matches: generated with chat_template_kwargs {"enable_thinking": true}, but '
            'this run renders with model.chat_template_kwargs {}') in str(refused.value)


def test_thinking_off_locally_supervises_the_answer_after_the_prefilled_think_block(tmp_path: Path,
                                                                                   thinking_target: Path) -> None:
    items = [{"id": f"q{index}", "messages": [{"role": "user", "content": question}]}
             for index, question in enumerate(["Hello, how are you?", "What is the capital of France?"])]
    cfg = prepare_run(tmp_path, thinking_target, items, max_new_tokens=6)
    cfg.model.chat_template_kwargs = {"enable_thinking": False}
    cfg.validation.eval_fraction = 0.0
    regenerated = regenerate.run(cfg)
    assert regenerated.report.ok == 2
    assert all(record.generation.chat_template_kwargs == {"enable_thinking": False}
               for record in by_id(regenerated.output_path).values())
    validate.run(cfg)
    captured = capture.run(cfg)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(thinking_target)
    think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    for row in FeatureSet(captured.features_dir, "train"):
        ids, mask = row["input_ids"].tolist(), row["loss_mask"].tolist()
        start = ids.index(think[0])
        assert ids[start + 1] == think[1], "the generation prompt pre-fills an empty think block"
        assert mask[start] == mask[start + 1] == 0 and sum(mask[start + 2:]) > 0, "the answer after it is supervised"
    cfg.training.max_steps, cfg.training.tokens_per_step, cfg.training.ttt_length = 2, 64, 2
    train.run(cfg)
    contract = json.loads((cfg.output_path / "draft" / "sglang" / "contract.json").read_text())
    assert contract["chat_template_kwargs"] == {"enable_thinking": False}, "serve with what training rendered"
