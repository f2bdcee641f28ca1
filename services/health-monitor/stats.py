"""Delivery statistics over rolling time windows, in bounded memory.

A window is a ring of time slots (24 × 1 h for the day, 5 × 1 min for "now"); each slot holds counts
and a latency sketch. A slot is placed by the record's own time, so rebuilding from the telemetry log
after a restart gives the same figures as having watched live. Memory per window is bounded by the
number of slots times the sketch's bucket count, whatever the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hookline.health_monitor.sketch import LatencySketch
from hookline.shared.contracts.telemetry import AttemptRecord, Outcome

AUTH_STATUSES = frozenset({401, 403})


@dataclass(slots=True)
class Stats:
    sketch: LatencySketch = field(default_factory=LatencySketch)
    attempts: int = 0
    successes: int = 0
    failures: int = 0  # retried: 5xx, 408, 429, timeouts, network
    timeouts: int = 0
    permanent: int = 0
    dead_letters: int = 0
    auth_rejected: int = 0  # 401/403: credentials changed?
    rate_limited: int = 0  # 429
    max_attempt: int = 0  # retry depth
    duration_sum_ms: float = 0.0

    def add(self, record: AttemptRecord) -> None:
        self.sketch.add(record.duration_ms)
        self.duration_sum_ms += record.duration_ms
        self.attempts += 1
        self.successes += record.outcome is Outcome.SUCCESS
        self.failures += record.outcome is Outcome.RETRY
        self.timeouts += record.error == "timeout"
        self.permanent += record.outcome in (Outcome.PERMANENT, Outcome.DISABLE)
        self.dead_letters += record.dead_letter_reason is not None
        self.auth_rejected += record.status in AUTH_STATUSES
        self.rate_limited += record.status == 429
        self.max_attempt = max(self.max_attempt, record.attempt)

    def merge(self, other: Stats) -> None:
        self.sketch.merge(other.sketch)
        self.attempts += other.attempts
        self.successes += other.successes
        self.failures += other.failures
        self.timeouts += other.timeouts
        self.permanent += other.permanent
        self.dead_letters += other.dead_letters
        self.auth_rejected += other.auth_rejected
        self.rate_limited += other.rate_limited
        self.max_attempt = max(self.max_attempt, other.max_attempt)
        self.duration_sum_ms += other.duration_sum_ms

    def mean_ms(self) -> float | None:
        return round(self.duration_sum_ms / self.attempts, 2) if self.attempts else None

    def percentile_ms(self, q: float) -> float | None:
        value = self.sketch.quantile(q)
        return round(value, 2) if value is not None else None

    def rate(self, part: int) -> float | None:
        return round(part / self.attempts, 4) if self.attempts else None


class RollingStats:
    def __init__(self, *, window_s: int, slot_s: int) -> None:
        self.window_s = window_s
        self.slot_s = slot_s
        self._slots: dict[int, Stats] = {}

    def add(self, record: AttemptRecord, *, now_s: float) -> None:
        slot = int(record.at_s // self.slot_s)
        if slot <= self._oldest_slot(now_s):
            return  # older than the window (a replayed record)
        stats = self._slots.get(slot)
        if stats is None:
            stats = self._slots[slot] = Stats()
            self._prune(now_s)
        stats.add(record)

    def total(self, *, now_s: float) -> Stats:
        oldest = self._oldest_slot(now_s)
        merged = Stats()
        for slot, stats in self._slots.items():
            if slot > oldest:
                merged.merge(stats)
        return merged

    def series(self, *, now_s: float) -> list[Stats | None]:
        """One entry per slot of the window, oldest first; None where nothing was recorded."""
        oldest = self._oldest_slot(now_s)
        return [self._slots.get(slot) for slot in range(oldest + 1, int(now_s // self.slot_s) + 1)]

    def _oldest_slot(self, now_s: float) -> int:
        return int(now_s // self.slot_s) - self.window_s // self.slot_s

    def _prune(self, now_s: float) -> None:
        oldest = self._oldest_slot(now_s)
        for slot in [slot for slot in self._slots if slot <= oldest]:
            del self._slots[slot]
