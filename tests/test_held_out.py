"""Which held-out records an evaluation set takes (tasks/data/held_out.stratified): spread over categories."""

from __future__ import annotations

from contract.records import PromptRecord, Provenance
from tasks.data.held_out import stratified


def record(number: int, category: str | None) -> PromptRecord:
    return PromptRecord(id=f"s:{number}", source="s", text=f"record {number}",
                        metadata={"category": category} if category else {},
                        provenance=Provenance(file="x.jsonl", line=number + 1, format="text"))


def test_each_category_gets_its_turn_and_its_share_is_spread_through_it() -> None:
    records = [record(n, "a") for n in range(6)] + [record(n, "b") for n in range(6, 9)] + [record(9, "c")]
    chosen = [item.id for item in stratified(records, 7)]
    # one each in turn: a, b, c, a, b, (c has no more) a, b -> a 3 of 6 (every other), b 3 of 3, c 1 of 1
    assert chosen == ["s:0", "s:2", "s:4", "s:6", "s:7", "s:8", "s:9"]


def test_without_categories_it_is_evenly_spaced_and_all_when_asked_for_more() -> None:
    records = [record(n, None) for n in range(10)]
    assert [item.id for item in stratified(records, 4)] == ["s:0", "s:2", "s:5", "s:7"]
    assert stratified(records, None) == records and stratified(records, 50) == records


def test_mtbench_shaped_categories_get_two_each() -> None:
    categories = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    records = [record(10 * index + n, name) for index, name in enumerate(categories) for n in range(10)]
    chosen = stratified(records, 16)
    counts = {name: sum(item.metadata["category"] == name for item in chosen) for name in categories}
    assert set(counts.values()) == {2}
    assert [item.id for item in chosen[:2]] == ["s:0", "s:5"]
