"""What an attempt's result means, and what then happens to the message: pure functions, tested with tables.

2xx                                   success   -> ack
408, 429, 5xx, timeouts, network, TLS  retry     -> try again later
410 Gone                               disable   -> dead letter, and the endpoint is disabled
other 4xx, 3xx (redirects are not followed), 1xx
refused target, invalid URL            permanent -> dead letter now
a transform that failed                permanent -> dead letter now (transform_failed): no retry storm
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from hookline.dispatcher.backoff import GiveUp, RetryPolicy, decide, honoured_retry_after_s
from hookline.shared.contracts.models import DeadLetterReason
from hookline.shared.contracts.telemetry import Outcome
from hookline.shared.outbound.delivery import ErrorKind

_PERMANENT_ERRORS = frozenset({ErrorKind.REFUSED_TARGET, ErrorKind.INVALID_URL, ErrorKind.TRANSFORM})
_RETRIED_4XX = frozenset({408, 429})


def classify(status: int | None, error: ErrorKind | None) -> Outcome:
    """The outcome of one attempt from its HTTP status, or from the error when there is no status."""
    if status is None:
        if error in _PERMANENT_ERRORS:
            return Outcome.PERMANENT
        return Outcome.RETRY
    if 200 <= status < 300:
        return Outcome.SUCCESS
    if status == 410:
        return Outcome.DISABLE
    if status in _RETRIED_4XX or 500 <= status < 600:
        return Outcome.RETRY
    return Outcome.PERMANENT


@dataclass(frozen=True, slots=True)
class Ack:
    """Delivered: ack the message."""


@dataclass(frozen=True, slots=True)
class Retry:
    """Schedule the next attempt through the delay queues (confirmed), then ack."""

    delay_s: int


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Keep the event as a dead letter (confirmed), then ack; ``disable`` also disables the endpoint."""

    reason: DeadLetterReason
    disable: bool = False


Settlement = Ack | Retry | DeadLetter


def settle(
    outcome: Outcome,
    *,
    status: int | None,
    attempt: int,
    first_attempt_at_s: float,
    now_s: float,
    policy: RetryPolicy,
    random: float,
    retry_after: str | None,
    now: datetime,
    error: ErrorKind | None = None,
) -> Settlement:
    """What to do with the message after an attempt: a pure function of the attempt and the policy."""
    if outcome is Outcome.SUCCESS:
        return Ack()
    if outcome is Outcome.DISABLE:
        return DeadLetter(DeadLetterReason.ENDPOINT_GONE, disable=True)
    if outcome is Outcome.PERMANENT:
        if error is ErrorKind.TRANSFORM:
            return DeadLetter(DeadLetterReason.TRANSFORM_FAILED)
        return DeadLetter(DeadLetterReason.PERMANENT_STATUS)
    retry_after_s = honoured_retry_after_s(
        retry_after, status=status, now=now, cap_s=policy.retry_after_cap_s
    )
    decision = decide(
        attempt,
        first_attempt_at_s=first_attempt_at_s,
        now_s=now_s,
        policy=policy,
        random=random,
        retry_after_s=retry_after_s,
    )
    if isinstance(decision, GiveUp):
        return DeadLetter(DeadLetterReason(decision.reason))
    return Retry(decision.delay_s)
