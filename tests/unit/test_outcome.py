"""The outcome of an attempt, from its status or error: the table in DESIGN.md "The delivery"."""

from __future__ import annotations

import pytest

from hookline.dispatcher.outcome import Outcome, classify
from hookline.shared.outbound.delivery import ErrorKind


@pytest.mark.parametrize(
    ("status", "error", "expected"),
    [
        (200, None, Outcome.SUCCESS),
        (201, None, Outcome.SUCCESS),
        (204, None, Outcome.SUCCESS),
        (299, None, Outcome.SUCCESS),
        (408, None, Outcome.RETRY),
        (429, None, Outcome.RETRY),
        (500, None, Outcome.RETRY),
        (502, None, Outcome.RETRY),
        (503, None, Outcome.RETRY),
        (504, None, Outcome.RETRY),
        (599, None, Outcome.RETRY),
        (410, None, Outcome.DISABLE),
        (400, None, Outcome.PERMANENT),
        (401, None, Outcome.PERMANENT),
        (403, None, Outcome.PERMANENT),
        (404, None, Outcome.PERMANENT),
        (413, None, Outcome.PERMANENT),
        (422, None, Outcome.PERMANENT),
        (301, None, Outcome.PERMANENT),
        (302, None, Outcome.PERMANENT),
        (307, None, Outcome.PERMANENT),
        (100, None, Outcome.PERMANENT),
        (None, ErrorKind.TIMEOUT, Outcome.RETRY),
        (None, ErrorKind.DNS, Outcome.RETRY),
        (None, ErrorKind.CONNECT, Outcome.RETRY),
        (None, ErrorKind.TLS, Outcome.RETRY),
        (None, ErrorKind.NETWORK, Outcome.RETRY),
        (None, ErrorKind.PROTOCOL, Outcome.RETRY),
        (None, ErrorKind.REFUSED_TARGET, Outcome.PERMANENT),
        (None, ErrorKind.INVALID_URL, Outcome.PERMANENT),
        (None, ErrorKind.TRANSFORM, Outcome.PERMANENT),  # no retry storm: it would fail again
    ],
)
def test_classify(status: int | None, error: ErrorKind | None, expected: Outcome) -> None:
    assert classify(status, error) is expected


# --- what happens to the message -----------------------------------------------------------------

from datetime import UTC, datetime  # noqa: E402

from hookline.dispatcher.backoff import Jitter, RetryPolicy  # noqa: E402
from hookline.dispatcher.outcome import Ack, DeadLetter, Retry, Settlement, settle  # noqa: E402
from hookline.shared.contracts.models import DeadLetterReason  # noqa: E402

POLICY = RetryPolicy(schedule_s=(30, 120), retention_s=3600, max_attempts=5, jitter=Jitter.NONE)
NOW = datetime(2026, 11, 29, 18, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("outcome", "status", "attempt", "elapsed_s", "retry_after", "expected"),
    [
        (Outcome.SUCCESS, 204, 1, 0, None, Ack()),
        (Outcome.RETRY, 500, 1, 0, None, Retry(30)),
        (Outcome.RETRY, 500, 2, 30, None, Retry(120)),
        (Outcome.RETRY, 500, 4, 300, None, Retry(120)),
        (Outcome.RETRY, 500, 5, 400, None, DeadLetter(DeadLetterReason.MAX_ATTEMPTS)),
        (Outcome.RETRY, 500, 3, 3500, None, DeadLetter(DeadLetterReason.RETENTION_EXPIRED)),
        (Outcome.RETRY, 429, 1, 0, "90", Retry(90)),
        (Outcome.RETRY, 503, 1, 0, "90", Retry(90)),
        (Outcome.RETRY, 500, 1, 0, "90", Retry(30)),  # Retry-After only counts on 429 and 503
        (Outcome.RETRY, None, 1, 0, None, Retry(30)),  # a timeout
        (Outcome.PERMANENT, 400, 1, 0, None, DeadLetter(DeadLetterReason.PERMANENT_STATUS)),
        (Outcome.DISABLE, 410, 1, 0, None, DeadLetter(DeadLetterReason.ENDPOINT_GONE, disable=True)),
    ],
)
def test_settle(
    outcome: Outcome,
    status: int | None,
    attempt: int,
    elapsed_s: float,
    retry_after: str | None,
    expected: Settlement,
) -> None:
    now_s = NOW.timestamp()
    result = settle(
        outcome, status=status, attempt=attempt, first_attempt_at_s=now_s - elapsed_s, now_s=now_s,
        policy=POLICY, random=0.5, retry_after=retry_after, now=NOW,
    )  # fmt: skip
    assert result == expected


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ErrorKind.TRANSFORM, DeadLetterReason.TRANSFORM_FAILED),
        (ErrorKind.INVALID_URL, DeadLetterReason.PERMANENT_STATUS),
    ],
)
def test_a_permanent_failure_says_why_in_its_dead_letter(error: ErrorKind, reason: DeadLetterReason) -> None:
    now_s = NOW.timestamp()
    result = settle(
        Outcome.PERMANENT, status=None, attempt=1, first_attempt_at_s=now_s, now_s=now_s,
        policy=POLICY, random=0.5, retry_after=None, now=NOW, error=error,
    )  # fmt: skip
    assert result == DeadLetter(reason)
