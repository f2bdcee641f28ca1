"""Latency percentiles in bounded memory: a log-bucketed histogram with a stated relative error.

Bucket ``i`` holds values in (γ^(i-1), γ^i] with γ = (1+α)/(1-α); answering with 2γ^i/(γ+1) puts
every quantile within a relative error α of a value really in the data (the DDSketch construction).
With α = 1 % and values between 0.01 ms and 10 min there are at most ~900 buckets, whatever the
number of samples, and two sketches merge by adding counts.

The counts are one dense array of 4-byte integers over the buckets between the lowest and the highest
seen (DDSketch's dense store): a typical endpoint's latencies span two or three orders of magnitude,
about 250-350 buckets, about 1-1.4 KB, where a dict of the same buckets took 10-16 KB (a hash table
plus an int object per key and per count). The monitor keeps one sketch per time slot, per endpoint and
per event type: the sketches are most of its memory.
"""

from __future__ import annotations

import math
import operator
from array import array
from collections.abc import Iterator, Mapping

RELATIVE_ERROR = 0.01
_GAMMA = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
_LOG_GAMMA = math.log(_GAMMA)
#: Smaller values (in ms) are counted as this value: far below anything a network round trip takes.
MIN_VALUE_MS = 0.01
#: Unsigned 32-bit counts: four billion samples in one bucket of one sketch is far beyond a day's traffic.
_TYPECODE = "I"


def _value(index: int) -> float:
    return 2 * _GAMMA**index / (_GAMMA + 1)


def bucket_of(value_ms: float) -> int:
    return math.ceil(math.log(max(value_ms, MIN_VALUE_MS)) / _LOG_GAMMA)


class LatencySketch:
    __slots__ = ("_counts", "_first", "count")

    def __init__(self) -> None:
        self._first = 0  # the bucket index of _counts[0]
        self._counts = array(_TYPECODE)
        self.count = 0

    @classmethod
    def of(cls, bins: Mapping[int, int]) -> LatencySketch:
        """A sketch holding these counts per bucket (as :attr:`bins` gives them)."""
        sketch = cls()
        for index, count in sorted(bins.items()):
            sketch._cover(index, index)
            sketch._counts[index - sketch._first] += count
            sketch.count += count
        return sketch

    @property
    def bins(self) -> dict[int, int]:
        """The non-empty buckets, lowest first: bucket index → count."""
        return dict(self._nonzero())

    def add(self, value_ms: float) -> None:
        index = bucket_of(value_ms)
        self._cover(index, index)
        self._counts[index - self._first] += 1
        self.count += 1

    def merge(self, other: LatencySketch) -> None:
        if not other.count:
            return
        self._cover(other._first, other._first + len(other._counts) - 1)
        start = other._first - self._first
        end = start + len(other._counts)
        # Element-wise, in C (map with operator.add): a day's total merges 24 slots of a few hundred buckets.
        self._counts[start:end] = array(_TYPECODE, map(operator.add, self._counts[start:end], other._counts))
        self.count += other.count

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0 ≤ q ≤ 1) within the relative error, or None without samples."""
        if self.count == 0:
            return None
        rank = q * (self.count - 1)
        seen = 0
        for index, count in self._nonzero():
            seen += count
            if seen > rank:
                return _value(index)
        return _value(self._first + len(self._counts) - 1)  # q = 1 with rounding: the highest bucket

    def _nonzero(self) -> Iterator[tuple[int, int]]:
        return ((self._first + offset, count) for offset, count in enumerate(self._counts) if count)

    def _cover(self, low: int, high: int) -> None:
        """Make the array span buckets ``low`` to ``high`` (it only ever grows)."""
        if not self._counts:
            self._first = low
            self._counts = array(_TYPECODE, bytes(4 * (high - low + 1)))
            return
        if low < self._first:
            self._counts = array(_TYPECODE, bytes(4 * (self._first - low))) + self._counts
            self._first = low
        last = self._first + len(self._counts) - 1
        if high > last:
            self._counts.extend(array(_TYPECODE, bytes(4 * (high - last))))
