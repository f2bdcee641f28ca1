"""Latency percentiles in bounded memory: a log-bucketed histogram with a stated relative error.

Bucket ``i`` holds values in (γ^(i-1), γ^i] with γ = (1+α)/(1-α); answering with 2γ^i/(γ+1) puts
every quantile within a relative error α of a value really in the data (the DDSketch construction).
With α = 1 % and values between 0.01 ms and 10 min there are at most ~900 buckets, whatever the
number of samples, and two sketches merge by adding counts.
"""

from __future__ import annotations

import math

RELATIVE_ERROR = 0.01
_GAMMA = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
_LOG_GAMMA = math.log(_GAMMA)
#: Smaller values (in ms) are counted as this value: far below anything a network round trip takes.
MIN_VALUE_MS = 0.01


class LatencySketch:
    __slots__ = ("bins", "count")

    def __init__(self) -> None:
        self.bins: dict[int, int] = {}
        self.count = 0

    def add(self, value_ms: float) -> None:
        index = math.ceil(math.log(max(value_ms, MIN_VALUE_MS)) / _LOG_GAMMA)
        self.bins[index] = self.bins.get(index, 0) + 1
        self.count += 1

    def merge(self, other: LatencySketch) -> None:
        for index, count in other.bins.items():
            self.bins[index] = self.bins.get(index, 0) + count
        self.count += other.count

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 ≤ q ≤ 1) within the relative error, or None without samples."""
        if self.count == 0:
            return None
        rank = q * (self.count - 1)
        seen = 0
        for index in sorted(self.bins):
            seen += self.bins[index]
            if seen > rank:
                return 2 * _GAMMA**index / (_GAMMA + 1)
        return 2 * _GAMMA ** max(self.bins) / (_GAMMA + 1)
