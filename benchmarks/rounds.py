"""How the benchmarks that alternate rounds report a repeated figure: its median, then the range the rounds spanned
(on a shared machine the spread is part of the result)."""

from __future__ import annotations

import statistics


def median_and_range(values: list[float], digits: int = 1) -> str:
    """'median [min-max]' of the rounds' values."""
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"
