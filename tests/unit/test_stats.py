"""Rolling windows: records count in the window of their own time, old slots drop out."""

from __future__ import annotations

from support.factories import attempt_record as record

from hookline.health_monitor.stats import RollingStats


def test_counts_and_rates() -> None:
    window = RollingStats(window_s=300, slot_s=60)
    now = 10_000.0
    window.add(record(now - 10), now_s=now)
    window.add(record(now - 20, outcome="retry", status=None, error="timeout", attempt=3), now_s=now)
    window.add(record(now - 30, outcome="retry", status=429), now_s=now)
    window.add(
        record(now - 40, outcome="permanent", status=401, dead_letter_reason="permanent_status"), now_s=now
    )
    total = window.total(now_s=now)
    assert (total.attempts, total.successes, total.failures, total.timeouts, total.permanent) == (
        4,
        1,
        2,
        1,
        1,
    )
    assert (total.dead_letters, total.auth_rejected, total.rate_limited, total.max_attempt) == (1, 1, 1, 3)
    assert total.rate(total.successes) == 0.25


def test_records_leave_the_window_as_time_passes() -> None:
    window = RollingStats(window_s=300, slot_s=60)
    window.add(record(1000, duration_ms=5000), now_s=1000)
    window.add(record(1200, duration_ms=10), now_s=1200)
    assert window.total(now_s=1200).attempts == 2
    assert window.total(now_s=1300).attempts == 1  # the slot of t=1000 is out of the 5 minutes
    assert abs((window.total(now_s=1300).percentile_ms(0.5) or 0) - 10.0) <= 0.1  # within 1 %
    window.add(record(900), now_s=1300)  # older than the window: ignored
    assert window.total(now_s=1300).attempts == 1
    assert window.total(now_s=2000).attempts == 0
