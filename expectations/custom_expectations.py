"""Custom GX row checks used by the record suite. Import this module before loading a suite that names them:
GX registers an expectation type when its class is defined, and drops unknown types from a loaded suite.

Both take a column whose values are sequences of texts (one per turn) and ask one yes/no question per row.
This module imports great_expectations at import time (~3-7 s): import it only where GX is needed.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

from great_expectations.execution_engine import PandasExecutionEngine
from great_expectations.expectations.expectation import ColumnMapExpectation
from great_expectations.expectations.metrics.map_metric_provider import (
    ColumnMapMetricProvider,
    column_condition_partial,
)
from great_expectations.render import LegacyRendererType, RenderedStringTemplateContent
from great_expectations.render.renderer.renderer import renderer

from contract.chat_rendering import THINK_CLOSE, THINK_OPEN

REASONING_MARKERS = (THINK_OPEN, THINK_CLOSE)


def all_non_blank(texts: Any) -> bool:
    return all(isinstance(text, str) and text.strip() for text in texts)


def free_of_reasoning_markers(texts: Any) -> bool:
    return not any(marker in text for text in texts for marker in REASONING_MARKERS)


class ColumnValuesNonBlankTexts(ColumnMapMetricProvider):
    condition_metric_name = "column_values.eaglet_non_blank_texts"

    @column_condition_partial(engine=PandasExecutionEngine)
    def _pandas(cls, column, **kwargs):
        return column.map(all_non_blank)


class ColumnValuesFreeOfReasoningMarkers(ColumnMapMetricProvider):
    condition_metric_name = "column_values.eaglet_free_of_reasoning_markers"

    @column_condition_partial(engine=PandasExecutionEngine)
    def _pandas(cls, column, **kwargs):
        return column.map(free_of_reasoning_markers)


class _RowCheck(ColumnMapExpectation):
    """Shared Data Docs sentence: `$column <rule>` (GX would otherwise print the raw kwargs)."""

    rule: ClassVar[str] = ""

    @classmethod
    @renderer(renderer_type=LegacyRendererType.PRESCRIPTIVE)
    def _prescriptive_renderer(cls, configuration: Optional[Any] = None, result: Optional[Any] = None,
                               runtime_configuration: Optional[dict] = None, **kwargs: Any) -> list:
        column = configuration.kwargs.get("column") if configuration is not None else None
        return [RenderedStringTemplateContent(
            content_block_type="string_template",
            string_template={"template": f"$column {cls.rule}", "params": {"column": column}},
        )]


class ExpectColumnValuesToBeNonBlankTexts(_RowCheck):
    """Every text of each value (a sequence of texts) has a non-whitespace character; an empty sequence passes."""

    map_metric: ClassVar[str] = "column_values.eaglet_non_blank_texts"
    rule: ClassVar[str] = "values: every text (one per turn) has a non-whitespace character."
    success_keys: ClassVar[tuple[str, ...]] = ("mostly",)
    library_metadata: ClassVar[dict[str, Any]] = {"tags": ["eaglet", "chat"], "contributors": ["eaglet"]}


class ExpectColumnValuesToBeFreeOfReasoningMarkers(_RowCheck):
    """No text of each value (a sequence of texts) contains `<think>` or `</think>`."""

    map_metric: ClassVar[str] = "column_values.eaglet_free_of_reasoning_markers"
    rule: ClassVar[str] = "values: no text (one per turn) contains a reasoning marker (&lt;think&gt; or &lt;/think&gt;)."
    success_keys: ClassVar[tuple[str, ...]] = ("mostly",)
    library_metadata: ClassVar[dict[str, Any]] = {"tags": ["eaglet", "chat", "reasoning"], "contributors": ["eaglet"]}


CUSTOM_TYPES = ("expect_column_values_to_be_non_blank_texts", "expect_column_values_to_be_free_of_reasoning_markers")
