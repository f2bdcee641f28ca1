"""Where an event stands at an endpoint, and why it waits: a table over the pure decision."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from hookline.ingest.timeline import standing
from hookline.shared.contracts.control import BreakerCommand, BreakerState
from hookline.shared.contracts.deadletters import DeadLetterItem
from hookline.shared.contracts.models import DeadLetterReason, EndpointStatus, SigningSecret, StoredEndpoint
from hookline.shared.contracts.telemetry import AttemptRecord, Deferral

NOW_S = 1_800_000_000.0
EP = "ep_" + "1" * 26
AT = datetime.fromtimestamp(NOW_S - 3600, UTC)
ENDPOINT = StoredEndpoint(
    id=EP, tenant="acme", url="https://example.com/", event_types=["#"], created_at=AT, updated_at=AT,
    secrets=[SigningSecret(value="whsec_" + "A" * 44, created_at=AT)], routed=True,
)  # fmt: skip


def endpoint(**changes: Any) -> StoredEndpoint:
    return ENDPOINT.model_copy(update=changes)


def attempt(
    n: int, outcome: str, *, kind: str = "delivery", status: int | None = 503, **more: Any
) -> AttemptRecord:
    return AttemptRecord.model_validate(
        {
            "at_s": NOW_S - 100 + n, "dispatcher_id": "d1", "event_id": "evt_1", "endpoint_id": EP,
            "tenant": "acme", "type": "a.b", "attempt": n, "outcome": outcome, "status": status, "error": None,
            "duration_ms": 5.0, "first_attempt_at_s": NOW_S - 100, "attempt_kind": kind, **more,
        }
    )  # fmt: skip


DEAD = DeadLetterItem(
    id="dl_7", event_id="evt_1", endpoint_id=EP, tenant="acme", type="a.b", reason=DeadLetterReason.ENDPOINT_GONE,
    attempts=0, last_status=None, last_error="gone", dead_at=datetime.fromtimestamp(NOW_S - 10, UTC),
)  # fmt: skip
OPEN = BreakerCommand(
    endpoint_id="ep_1",
    state=BreakerState.OPEN,
    version=1,
    opened_at_s=NOW_S - 5,
    cooldown_s=30,
    consecutive_failures=3,
)
RETRY_LATER = attempt(1, "retry", next_attempt_at_s=NOW_S + 60)


@pytest.mark.parametrize(
    ("known", "attempts", "dead", "breaker", "state", "reason"),
    [
        pytest.param(ENDPOINT, [], [], None, "pending", "queued for delivery", id="not attempted yet"),
        pytest.param(
            ENDPOINT, [attempt(1, "success", status=200)], [], None, "delivered", None, id="delivered"
        ),
        pytest.param(
            ENDPOINT,
            [RETRY_LATER, attempt(2, "success", kind="retry", status=200)],
            [],
            OPEN,
            "delivered",
            None,
            id="delivered wins over anything after",
        ),
        pytest.param(
            ENDPOINT,
            [RETRY_LATER],
            [],
            None,
            "retrying",
            "failed (HTTP 503); in a delay queue until",
            id="retry",
        ),
        pytest.param(
            ENDPOINT,
            [attempt(1, "retry", next_attempt_at_s=NOW_S - 1)],
            [],
            None,
            "retrying",
            "due, waiting for a dispatcher",
            id="retry due",
        ),
        pytest.param(
            ENDPOINT,
            [attempt(1, "retry", status=None, error="timeout", next_attempt_at_s=NOW_S + 9)],
            [],
            None,
            "retrying",
            "failed (timeout)",
            id="no status",
        ),
        pytest.param(
            ENDPOINT,
            [RETRY_LATER],
            [],
            OPEN,
            "breaker_open",
            "open circuit breaker (after 3 failures)",
            id="breaker",
        ),
        pytest.param(
            endpoint(status=EndpointStatus.PAUSED),
            [RETRY_LATER],
            [],
            OPEN,
            "paused",
            "the endpoint is paused",
            id="paused",
        ),
        pytest.param(
            endpoint(status=EndpointStatus.DISABLED), [], [], None, "disabled", "disabled", id="disabled"
        ),
        pytest.param(endpoint(verified=False), [], [], None, "unverified", "verification", id="unverified"),
        pytest.param(
            ENDPOINT,
            [attempt(1, "permanent", status=400, dead_letter_reason="permanent_status")],
            [],
            None,
            "dead",
            "dead-lettered (permanent_status)",
            id="dead after a 4xx",
        ),
        pytest.param(
            None, [RETRY_LATER], [DEAD], None, "dead", "dead-lettered (endpoint_gone)", id="endpoint deleted"
        ),
        pytest.param(None, [], [], None, "dead", "the endpoint was deleted", id="deleted, nothing yet known"),
        pytest.param(
            ENDPOINT,
            [
                attempt(1, "permanent", status=400, dead_letter_reason="permanent_status"),
                attempt(1, "retry", kind="redrive", next_attempt_at_s=NOW_S + 5),
            ],
            [],
            None,
            "retrying",
            "in a delay queue",
            id="redriven: its new course counts",
        ),
        pytest.param(
            ENDPOINT,
            [RETRY_LATER, attempt(2, "failed", kind="manual", status=500)],
            [],
            None,
            "retrying",
            "attempt 1 failed",
            id="a failed manual attempt changes nothing",
        ),
        pytest.param(
            ENDPOINT,
            [RETRY_LATER, attempt(2, "success", kind="manual", status=200)],
            [],
            None,
            "delivered",
            None,
            id="a manual success delivers it",
        ),
        pytest.param(
            endpoint(kind="polling", url=None),
            [],
            [],
            None,
            "pending",
            "not fetched yet",
            id="polling, not fetched",
        ),
        pytest.param(
            endpoint(kind="polling", url=None),
            [attempt(1, "success", kind="poll", status=200)],
            [],
            None,
            "delivered",
            None,
            id="polling, fetched",
        ),
        pytest.param(
            endpoint(rate_limit_per_s=5.0, ordered=True),
            [],
            [],
            None,
            "pending",
            "paced at 5/s; ordered",
            id="paced, ordered",
        ),
    ],
)
def test_standing(
    known: StoredEndpoint | None,
    attempts: list[AttemptRecord],
    dead: list[DeadLetterItem],
    breaker: BreakerCommand | None,
    state: str,
    reason: str | None,
) -> None:
    found = standing(known, attempts, dead, breaker, now_s=NOW_S)
    assert found.state == state
    if reason is None:
        assert found.waiting_reason is None
    else:
        assert found.waiting_reason is not None
        assert reason in found.waiting_reason
    assert (found.next_attempt_at is not None) == (state in ("retrying", "breaker_open") and bool(attempts))


def deferral(reason: str, *, at_s: float, until_s: float, behind: str | None = None) -> Deferral:
    return Deferral.model_validate(
        {"at_s": at_s, "dispatcher_id": "d1", "event_id": "evt_1", "endpoint_id": EP, "tenant": "acme",
         "reason": reason, "behind_event_id": behind, "until_s": until_s}
    )  # fmt: skip


@pytest.mark.parametrize(
    ("attempts", "put_back", "state", "reason"),
    [
        pytest.param(
            [],
            deferral("ordering", at_s=NOW_S - 1, until_s=NOW_S + 9, behind="evt_0"),
            "pending",
            "held back by ordering behind event evt_0",
            id="behind an earlier event",
        ),
        pytest.param(
            [],
            deferral("pacing", at_s=NOW_S - 1, until_s=NOW_S + 9),
            "pending",
            "paced by the endpoint's rate limit",
            id="paced",
        ),
        pytest.param(
            [RETRY_LATER],
            deferral("ordering", at_s=NOW_S - 200, until_s=NOW_S + 9),
            "retrying",
            "attempt 1 failed",
            id="an attempt since: the deferral is history",
        ),
        pytest.param(
            [],
            deferral("pacing", at_s=NOW_S - 20, until_s=NOW_S - 10),
            "pending",
            "queued for delivery",
            id="back from the delay queues: queued again",
        ),
    ],
)
def test_an_event_put_back_says_why(
    attempts: list[AttemptRecord], put_back: Deferral, state: str, reason: str
) -> None:
    found = standing(ENDPOINT, attempts, [], None, put_back, now_s=NOW_S)
    assert found.state == state
    assert found.waiting_reason is not None
    assert reason in found.waiting_reason
