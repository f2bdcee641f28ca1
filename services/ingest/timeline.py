"""Where an event stands at one endpoint, and why it waits: a pure function of what is known about it.

The attempts come from the delivery log, the endpoint from the change log, the breaker from the breaker
log and the dead letters from their index; time is passed in. The answer is the one a support engineer
needs: not only "3 attempts, last one 503" but "in a delay queue until 14:05", "behind an open
breaker", "the endpoint is paused".
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from hookline.shared.contracts.control import BreakerCommand, BreakerState
from hookline.shared.contracts.deadletters import DeadLetterItem
from hookline.shared.contracts.models import EndpointStatus, EventState, Model, StoredEndpoint
from hookline.shared.contracts.telemetry import ASIDE_KINDS, AttemptRecord, Deferral, Outcome
from hookline.shared.outbound.filters import Verdict


class Standing(Model):
    state: EventState
    next_attempt_at: datetime | None
    waiting_reason: str | None  # None once delivered


def standing(
    endpoint: StoredEndpoint | None,
    attempts: Sequence[AttemptRecord],
    dead_letters: Sequence[DeadLetterItem],
    breaker: BreakerCommand | None,
    deferral: Deferral | None = None,
    *,
    now_s: float,
) -> Standing:
    """The event's state at the endpoint. ``attempts`` in the order they were made; ``dead_letters``
    those of this event at this endpoint not redriven since; ``deferral`` the last time it was put back
    without an attempt (not its turn yet)."""
    if any(attempt.outcome == Outcome.SUCCESS for attempt in attempts):
        return Standing(state="delivered", next_attempt_at=None, waiting_reason=None)
    if endpoint is not None and endpoint.polling:
        return Standing(
            state="pending", next_attempt_at=None,
            waiting_reason="not fetched yet: a polling endpoint's events wait until its customer polls for them",
        )  # fmt: skip
    course = [attempt for attempt in attempts if attempt.attempt_kind not in ASIDE_KINDS]
    last = course[-1] if course else None
    dead = last is not None and last.dead_letter_reason is not None
    if dead or (dead_letters and (last is None or dead_letters[-1].dead_at.timestamp() >= last.at_s)):
        reason = last.dead_letter_reason if dead and last is not None else dead_letters[-1].reason.value
        return Standing(
            state="dead",
            next_attempt_at=None,
            waiting_reason=f"dead-lettered ({reason}); redrive it to try again",
        )
    if endpoint is None:
        return Standing(state="dead", next_attempt_at=None, waiting_reason="the endpoint was deleted")
    next_at_s = last.next_attempt_at_s if last is not None else None
    next_at = datetime.fromtimestamp(next_at_s, UTC) if next_at_s is not None else None
    if (held := _held_by_endpoint(endpoint)) is not None:
        return held
    if breaker is not None and breaker.state is not BreakerState.CLOSED:
        probe_at = (breaker.opened_at_s or now_s) + breaker.cooldown_s
        return Standing(
            state="breaker_open", next_attempt_at=next_at,
            waiting_reason=f"behind the endpoint's open circuit breaker (after {breaker.consecutive_failures} "
            f"failures); a probe goes out at {_clock(probe_at)}, deliveries resume when it succeeds",
        )  # fmt: skip
    if deferral is not None and (last is None or deferral.at_s > last.at_s) and deferral.until_s > now_s:
        if deferral.reason == "ordering":
            behind = f" behind event {deferral.behind_event_id}" if deferral.behind_event_id else ""
            why = f"held back by ordering{behind} (same subject, published earlier) until {_clock(deferral.until_s)}"
        elif deferral.reason == "slow_share":
            why = (
                "the endpoint answers slowly and the dispatchers' connections for slow endpoints are all "
                f"busy; put back until {_clock(deferral.until_s)}"
            )
        else:
            why = f"paced by the endpoint's rate limit (or a 429's Retry-After) until {_clock(deferral.until_s)}"
        return Standing(
            state="pending", next_attempt_at=datetime.fromtimestamp(deferral.until_s, UTC), waiting_reason=why
        )
    if last is not None and next_at_s is not None:
        if next_at_s > now_s:
            why = f"attempt {last.attempt} failed ({_failure(last)}); in a delay queue until {_clock(next_at_s)}"
        else:
            why = f"attempt {last.attempt} failed ({_failure(last)}); due, waiting for a dispatcher"
        return Standing(state="retrying", next_attempt_at=next_at, waiting_reason=why)
    return Standing(state="pending", next_attempt_at=None, waiting_reason=_queued(endpoint))


def filtered_out(verdict: Verdict) -> Standing:
    """An event the endpoint's filter does not match: never queued or sent to it."""
    why = (
        "the endpoint's filter does not match it: not sent"
        if verdict.error is None
        else f"the endpoint's filter could not be evaluated on it ({verdict.error}): not sent"
    )
    return Standing(state="filtered", next_attempt_at=None, waiting_reason=why)


def _held_by_endpoint(endpoint: StoredEndpoint) -> Standing | None:
    """An endpoint that takes no deliveries until an operator acts, and what to do."""
    if endpoint.status is EndpointStatus.DISABLED:
        return Standing(
            state="disabled",
            next_attempt_at=None,
            waiting_reason="the endpoint is disabled; resume it to deliver",
        )
    if endpoint.status is EndpointStatus.PAUSED:
        return Standing(
            state="paused",
            next_attempt_at=None,
            waiting_reason="the endpoint is paused; resume it to deliver",
        )
    if not endpoint.verified:
        return Standing(
            state="unverified", next_attempt_at=None,
            waiting_reason="the endpoint has not answered its verification request yet; verify it to deliver",
        )  # fmt: skip
    return None


def _queued(endpoint: StoredEndpoint) -> str:
    why = "queued for delivery"
    if endpoint.rate_limit_per_s is not None:
        why += f"; the endpoint is paced at {endpoint.rate_limit_per_s:g}/s"
    if endpoint.ordered:
        why += "; ordered: it goes out after the earlier events of its subject"
    return why


def _failure(attempt: AttemptRecord) -> str:
    return f"HTTP {attempt.status}" if attempt.status is not None else attempt.error or "no answer"


def _clock(at_s: float) -> str:
    return datetime.fromtimestamp(at_s, UTC).isoformat(timespec="seconds")
