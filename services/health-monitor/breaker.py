"""The circuit breaker of one endpoint: a pure state machine, time passed in.

    closed ──(threshold consecutive failures)──▶ open ──(cooldown elapsed)──▶ half_open
      ▲                                            ▲                              │
      └────────────(the probe succeeds)────────────┼──────────────────────────────┤
                                                   └──(the probe fails: cooldown doubled, ≤ max)─┘

Only attempts that say something about the endpoint count: successes, and failures that are retried
(5xx, 408, 429, timeouts, network and TLS errors). A 4xx is about the event, not the endpoint.
While open, results of attempts that were already under way are ignored; in half-open exactly one
probe is delivered and its result decides.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hookline.shared.contracts.control import BreakerState

__all__ = ["Breaker", "BreakerPolicy", "BreakerState", "open_for_s", "record", "tick"]


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    failure_threshold: int = 10
    cooldown_s: float = 300.0
    max_cooldown_s: float = 3600.0


@dataclass(frozen=True, slots=True)
class Breaker:
    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    opened_at_s: float | None = None  # when it last opened
    first_opened_at_s: float | None = None  # when it opened after last being closed
    cooldown_s: float = 0.0


def record(
    breaker: Breaker, *, success: bool, now_s: float, policy: BreakerPolicy, threshold: int
) -> Breaker:
    """A delivery result for this endpoint. ``threshold`` may be lower than the policy's (slow endpoints)."""
    match breaker.state:
        case BreakerState.CLOSED if success:
            return breaker if breaker.consecutive_failures == 0 else replace(breaker, consecutive_failures=0)
        case BreakerState.CLOSED:
            failures = breaker.consecutive_failures + 1
            if failures >= threshold:
                return Breaker(BreakerState.OPEN, failures, now_s, now_s, policy.cooldown_s)
            return replace(breaker, consecutive_failures=failures)
        case BreakerState.HALF_OPEN if success:
            return Breaker()
        case BreakerState.HALF_OPEN:
            cooldown_s = min(breaker.cooldown_s * 2, policy.max_cooldown_s)
            return replace(breaker, state=BreakerState.OPEN, opened_at_s=now_s, cooldown_s=cooldown_s)
        case _:  # open: a delivery that started before it opened; it proves nothing new
            return breaker


def tick(breaker: Breaker, *, now_s: float) -> Breaker:
    """Time passes: an open breaker whose cooldown has elapsed lets one probe through."""
    opened_at_s = breaker.opened_at_s
    if (
        breaker.state is BreakerState.OPEN
        and opened_at_s is not None
        and now_s >= opened_at_s + breaker.cooldown_s
    ):
        return replace(breaker, state=BreakerState.HALF_OPEN)
    return breaker


def open_for_s(breaker: Breaker, *, now_s: float) -> float:
    """How long the endpoint has been failing without a successful probe (0 when closed)."""
    if breaker.state is BreakerState.CLOSED or breaker.first_opened_at_s is None:
        return 0.0
    return now_s - breaker.first_opened_at_s
