"""A latency sparkline: a series of numbers (gaps allowed) as SVG polyline points, drawn server-side."""

from __future__ import annotations

from collections.abc import Sequence


def points(values: Sequence[float | None], *, width: int = 120, height: int = 24) -> str:
    """``x,y`` pairs for an SVG polyline, the highest value at the top; gaps (None) are skipped, and the
    line starts where the data does (an endpoint an hour old fills the width, a new one too)."""
    first = next((i for i, v in enumerate(values) if v is not None), len(values))
    values = values[first:]
    known = [v for v in values if v is not None]
    if len(known) < 2:
        return ""  # one point draws no line
    top = max(known) or 1.0
    step = width / (len(values) - 1)
    pairs = (
        f"{round(i * step, 1)},{round(height - (v / top) * (height - 2) - 1, 1)}"
        for i, v in enumerate(values)
        if v is not None
    )
    return " ".join(pairs)
