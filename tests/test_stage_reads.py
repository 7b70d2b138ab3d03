"""Every config field a stage reads is declared in flows/stages.py STAGE_READS (which keys the Prefect cache and
dvc.yaml's params): each stage runs on the tiny target with a config that records every field read."""

from __future__ import annotations

from pathlib import Path

import pytest

from config_reads import ConfigReads
from contract.config import RunConfig
from flows.stages import NOT_INPUTS, STAGE_ORDER, STAGE_READS, stage_function
from pipeline_inputs import tiny_run_config, write_conversations


@pytest.mark.integration  # register asks git for the commit
def test_every_stage_reads_only_what_it_declares(tmp_path: Path, tiny_target_dir: Path) -> None:
    chats = write_conversations(tmp_path / "inputs" / "chats.jsonl")
    cfg = RunConfig.model_validate(tiny_run_config(str(tmp_path / "out"), tiny_target_dir, str(chats), {"enabled": False}))
    undeclared: dict[str, list[str]] = {}
    for name in STAGE_ORDER:
        with ConfigReads() as reads:
            stage_function(name)(cfg)
        assert reads.fields, f"{name} read no config field: the recorder is not recording"
        missing = reads.undeclared(STAGE_READS[name].params, [*NOT_INPUTS, *STAGE_READS[name].not_inputs])
        if missing:
            undeclared[name] = missing
    assert not undeclared, f"fields read but not declared in flows/stages.py STAGE_READS: {undeclared}"


def test_the_recorder_sees_a_field_read_through_a_copy_or_a_section_dump() -> None:
    cfg = RunConfig()
    with ConfigReads() as reads:
        copy = cfg.model_copy(update={"training": cfg.training.model_copy(update={"epochs": 2})})
        assert copy.training.epochs == 2
        cfg.runtime.engines["vllm"].port
        cfg.regeneration.model_dump(mode="json")
        cfg.model_dump()  # the whole config written as a record: not an input
    assert reads.fields == {"training.epochs", "runtime.engines.*.port", "regeneration"}
    assert reads.undeclared(["training", "regeneration"]) == ["runtime.engines.*.port"]
    assert reads.undeclared(["training", "regeneration", "runtime.engines.vllm.port"]) == []
    assert reads.undeclared(["training", "regeneration.seed", "runtime.engines"]) == ["regeneration"]
    with pytest.raises(AttributeError):
        cfg.not_a_field  # noqa: B018 (reads outside the block are not recorded, errors are untouched)
