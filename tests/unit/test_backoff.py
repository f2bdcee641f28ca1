"""The retry schedule, jitter, Retry-After and the limits, as tables."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hookline.dispatcher.backoff import (
    GiveUp,
    Jitter,
    RetryIn,
    RetryPolicy,
    decide,
    delay_s,
    honoured_retry_after_s,
    parse_retry_after,
)

DEFAULT = RetryPolicy(schedule_s=(30, 120, 600, 1800, 7200, 21600), retention_s=259200)
EXACT = RetryPolicy(schedule_s=(30, 120, 600, 1800, 7200, 21600), retention_s=259200, jitter=Jitter.NONE)


@pytest.mark.parametrize(
    ("attempt", "expected_s"),
    [(1, 30), (2, 120), (3, 600), (4, 1800), (5, 7200), (6, 21600), (7, 21600), (40, 21600)],
)
def test_the_schedule_then_every_six_hours(attempt: int, expected_s: int) -> None:
    assert delay_s(attempt, EXACT, random=0.5) == expected_s


@pytest.mark.parametrize(
    ("attempt", "random", "expected_s"),
    [(1, 0.0, 1), (1, 0.5, 15), (1, 0.999, 30), (2, 0.25, 30), (6, 0.5, 10800), (1, 0.01, 1)],
)
def test_full_jitter_is_uniform_between_zero_and_the_step(
    attempt: int, random: float, expected_s: int
) -> None:
    assert delay_s(attempt, DEFAULT, random=random) == expected_s


@pytest.mark.parametrize(
    ("random", "retry_after_s", "expected_s"),
    [
        (0.5, 3, 15),  # shorter than the drawn delay: the drawn one stands
        (0.0, 3, 3),  # longer: it wins
        (0.5, 100, 100),
        (0.5, 7200, 3600),  # capped at one hour
        (0.5, None, 15),
    ],
)
def test_retry_after_sets_the_delay_when_longer(
    random: float, retry_after_s: float | None, expected_s: int
) -> None:
    assert delay_s(1, DEFAULT, random=random, retry_after_s=retry_after_s) == expected_s


@pytest.mark.parametrize(
    ("attempt", "elapsed_s", "policy", "expected"),
    [
        (1, 0, DEFAULT, RetryIn(15)),
        (5, 100, RetryPolicy(schedule_s=(1,), retention_s=1000, max_attempts=5), GiveUp("max_attempts")),
        (4, 100, RetryPolicy(schedule_s=(1,), retention_s=1000, max_attempts=5), RetryIn(1)),
        (9, 259200 - 10000, DEFAULT, GiveUp("retention_expired")),
        (9, 259200 - 20000, DEFAULT, RetryIn(10800)),
    ],
)
def test_decide(attempt: int, elapsed_s: float, policy: RetryPolicy, expected: RetryIn | GiveUp) -> None:
    now_s = 1_800_000_000.0
    result = decide(attempt, first_attempt_at_s=now_s - elapsed_s, now_s=now_s, policy=policy, random=0.5)
    assert result == expected


NOW = datetime(2026, 11, 29, 18, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("3", 3.0),
        (" 120 ", 120.0),
        ("Sun, 29 Nov 2026 18:00:30 GMT", 30.0),
        ("Sun, 29 Nov 2026 17:59:00 GMT", 0.0),  # in the past: now
        ("soon", None),
        ("-5", None),
        ("", None),
        (None, None),
        ("²", None),  # a Unicode digit: str.isdigit() says yes, float() says no
        ("١٢", None),  # Arabic-Indic digits
        ("1.5", None),
        ("Sun, 29 Nov 99999 18:00:30 GMT", None),
        ("Mon, 31 Feb 2026 18:00:30 GMT", None),
    ],
)
def test_parse_retry_after(header: str | None, expected: float | None) -> None:
    assert parse_retry_after(header, now=NOW) == expected


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(), st.from_regex(r"\A\s*[0-9]{1,400}\s*\Z"), st.from_regex(r"\A[A-Za-z]{3}, .*\Z")))
def test_parse_retry_after_never_raises(header: str) -> None:
    """Whatever a receiver sends in Retry-After: a number of seconds, or None."""
    parsed = parse_retry_after(header, now=NOW)
    assert parsed is None or parsed >= 0
    if parsed is not None:
        # and the delay it leads to is bounded by the cap, never an overflow
        assert delay_s(1, DEFAULT, random=0.5, retry_after_s=parsed) <= DEFAULT.retry_after_cap_s


@pytest.mark.parametrize(
    ("status", "header", "expected"),
    [
        (429, "90", 90.0),
        (503, "90", 90.0),
        (500, "90", None),  # honoured on 429 and 503 only
        (None, "90", None),  # a timeout has no header to honour
        (429, "7200", 3600.0),  # capped
        (429, "soon", None),
        (429, None, None),
    ],
)
def test_a_retry_after_is_honoured_on_429_and_503_and_capped(
    status: int | None, header: str | None, expected: float | None
) -> None:
    assert honoured_retry_after_s(header, status=status, now=NOW, cap_s=3600.0) == expected
