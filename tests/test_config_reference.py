"""docs/configuration.md's field tables are generated from contract/config.py: the test fails when they drift."""

from __future__ import annotations

from contract import config_reference
from contract.config import RunConfig


def test_docs_configuration_matches_the_schema() -> None:
    expected = config_reference.expected_document()
    actual = config_reference.DOC_PATH.read_text(encoding="utf-8")
    assert actual == expected, (f"{config_reference.DOC_PATH} differs from the schema in contract/config.py; "
                                f"regenerate it: {config_reference.REGENERATE}")


def test_every_field_of_every_section_has_a_row() -> None:
    body = config_reference.render()
    for section in config_reference.sections():
        for name in section.model.model_fields:
            row = f"| `{config_reference.joined(section.prefix, name)}` |"
            assert row in body, f"no row for {row}"
    assert "### `runtime.engines.<engine>`" in body and "### `data.sources[]`" in body
    assert set(RunConfig.model_fields) <= {line.split("`")[1] for line in body.splitlines() if line.startswith("| `")}


def test_the_block_is_replaced_and_the_hand_written_text_kept() -> None:
    document = f"# Title\n\nintro\n\n{config_reference.BEGIN}\nold\n{config_reference.END}\n\nafter\n"
    updated = config_reference.with_generated_block(document, "new\n")
    assert updated == f"# Title\n\nintro\n\n{config_reference.BEGIN}\n\nnew\n\n{config_reference.END}\n\nafter\n"
    assert config_reference.with_generated_block(updated, "new\n") == updated
