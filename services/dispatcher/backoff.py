"""When to try again, or when to stop: pure functions of the attempt, the policy, the response and a
random number, so the schedule can be tested exactly.

Default schedule (DESIGN.md): 30 s, 2 min, 10 min, 30 min, 2 h, then every 6 h, each step with full
jitter (uniform between 0 and the step), until the retention limit (3 days) or ``max_attempts``.
``Retry-After`` on 429/503 sets the delay when it is longer than the drawn one, capped.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime

#: Delays travel through TTL queues with one-second precision; a retry never comes back sooner.
MIN_DELAY_S = 1


class Jitter(enum.StrEnum):
    FULL = "full"  # uniform between 0 and the step: retries of a burst spread out
    NONE = "none"  # exactly the step


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    schedule_s: tuple[float, ...]
    retention_s: float
    max_attempts: int | None = None
    jitter: Jitter = Jitter.FULL
    retry_after_cap_s: float = 3600.0


@dataclass(frozen=True, slots=True)
class RetryIn:
    delay_s: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str  # "max_attempts" or "retention_expired" (DeadLetterReason values)


RETRY_AFTER_STATUSES = frozenset({429, 503})


def step_s(attempt: int, schedule_s: tuple[float, ...]) -> float:
    """The step after failed attempt ``attempt`` (1-based); the last step repeats."""
    return schedule_s[min(attempt, len(schedule_s)) - 1]


def delay_s(attempt: int, policy: RetryPolicy, *, random: float, retry_after_s: float | None = None) -> int:
    """Whole seconds to wait after failed attempt ``attempt``; ``random`` is uniform in [0, 1)."""
    step = step_s(attempt, policy.schedule_s)
    drawn = step * random if policy.jitter is Jitter.FULL else step
    if retry_after_s is not None:
        drawn = max(drawn, min(retry_after_s, policy.retry_after_cap_s))
    return max(MIN_DELAY_S, math.ceil(drawn))


def decide(
    attempt: int,
    *,
    first_attempt_at_s: float,
    now_s: float,
    policy: RetryPolicy,
    random: float,
    retry_after_s: float | None = None,
) -> RetryIn | GiveUp:
    """After failed attempt ``attempt``: retry after a delay, or give up and say why."""
    if policy.max_attempts is not None and attempt >= policy.max_attempts:
        return GiveUp("max_attempts")
    wait_s = delay_s(attempt, policy, random=random, retry_after_s=retry_after_s)
    if now_s + wait_s - first_attempt_at_s > policy.retention_s:
        return GiveUp("retention_expired")
    return RetryIn(wait_s)


def honoured_retry_after_s(
    value: str | None, *, status: int | None, now: datetime, cap_s: float
) -> float | None:
    """What a ``Retry-After`` asks for, in seconds, when hookline honours it (on a 429 or a 503),
    capped at ``cap_s``; None otherwise. The one place both rules live: the retry's delay and the
    endpoint's pause after a 429 come from it."""
    if status not in RETRY_AFTER_STATUSES:
        return None
    asked_s = parse_retry_after(value, now=now)
    return None if asked_s is None else min(asked_s, cap_s)


def parse_retry_after(value: str | None, *, now: datetime) -> float | None:
    """``Retry-After`` as seconds from ``now``: delta-seconds or an HTTP date; None if absent or garbled.

    Whatever a receiver sends, this never raises: ``"²".isdigit()`` is true in Python, but ``float("²")``
    is not a number, so only ASCII digits count as delta-seconds.
    """
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)  # may be inf for absurd lengths; callers cap it
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        return None
    try:
        return max(0.0, (when - now).total_seconds())
    except OverflowError:
        return None
