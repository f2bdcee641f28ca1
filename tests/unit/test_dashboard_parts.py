"""The dashboard's pure parts: sessions, the sparkline and which endpoints come first."""

from __future__ import annotations

import pytest

from hookline.health_monitor.dashboard import EndpointRow, _page, ranked
from hookline.health_monitor.sessions import Sessions
from hookline.health_monitor.sparkline import points
from hookline.shared.contracts.control import BreakerState
from hookline.shared.contracts.status import EndpointHealthView, Percentiles


def test_a_session_lives_until_it_expires_or_is_closed() -> None:
    sessions = Sessions(ttl_s=60)
    session = sessions.open(token="t" * 20, tenant="acme", now_s=1000.0)
    assert sessions.get(session.id, now_s=1059.0) == session
    assert sessions.get(session.id, now_s=1060.0) is None  # expired, and forgotten
    assert len(sessions) == 0
    other = sessions.open(token="t" * 20, tenant=None, now_s=1000.0)
    sessions.close(other.id)
    assert sessions.get(other.id, now_s=1000.0) is None
    assert sessions.get(None, now_s=1000.0) is None
    assert sessions.get("", now_s=1000.0) is None


def test_sessions_are_bounded_the_oldest_going_first() -> None:
    sessions = Sessions(max_sessions=2)
    first, second, third = (sessions.open(token="t" * 20, tenant=None, now_s=0.0) for _ in range(3))
    assert sessions.get(first.id, now_s=1.0) is None
    assert sessions.get(second.id, now_s=1.0)
    assert sessions.get(third.id, now_s=1.0)


def test_a_session_accepts_only_its_own_form_token_and_tenant() -> None:
    session = Sessions().open(token="t" * 20, tenant="acme", now_s=0.0)
    assert session.accepts(session.csrf)
    assert not session.accepts("")
    assert not session.accepts(session.csrf + "x")
    assert session.may_see("acme")
    assert not session.may_see("globex")
    assert not session.may_see(None)
    admin = Sessions().open(token="t" * 20, tenant=None, now_s=0.0)
    assert admin.may_see("globex")
    assert admin.may_see(None)
    assert admin.id != session.id
    assert admin.csrf != session.csrf


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], ""),
        ([None, None], ""),
        ([5.0, None], ""),  # one point draws no line
        ([0.0, 10.0], "0.0,23.0 120.0,1.0"),
        ([10.0, None, 5.0], "0.0,1.0 120.0,12.0"),
        ([0.0, 0.0], "0.0,23.0 120.0,23.0"),
        ([None, None, 4.0, 8.0], "0.0,12.0 120.0,1.0"),  # from where the data starts
    ],
)
def test_sparkline_points(values: list[float | None], expected: str) -> None:
    assert points(values) == expected


def _row(
    endpoint_id: str, breaker: BreakerState, *, slow: bool = False, p95_ms: float | None = None
) -> EndpointRow:
    recent = Percentiles(p50_ms=None, p95_ms=p95_ms, p99_ms=None, samples=0)
    health = EndpointHealthView(
        endpoint_id=endpoint_id, tenant="acme", status="active", breaker_state=breaker,
        breaker_cooldown_s=0, consecutive_failures=0, slow=slow, p50_ms=None, p95_ms=None, p99_ms=None,
        samples=0, last_5m=recent, success_rate=None, timeout_rate=None, attempts=0, dead_lettered=0,
        retry_depth=0, queue_depth=None, oldest_pending_age_s=None,
    )  # fmt: skip
    return EndpointRow(health=health, url="https://example.com/", sparkline="")


def test_degrading_endpoints_come_first() -> None:
    rows = [
        _row("fast", BreakerState.CLOSED, p95_ms=10),
        _row("slower", BreakerState.CLOSED, p95_ms=300),
        _row("slow", BreakerState.CLOSED, slow=True, p95_ms=2500),
        _row("probing", BreakerState.HALF_OPEN),
        _row("open", BreakerState.OPEN),
    ]
    assert [r.health.endpoint_id for r in ranked(rows)] == ["open", "probing", "slow", "slower", "fast"]
    assert [r.degrading for r in rows] == [False, False, True, True, True]


def test_every_page_renders_and_escapes_what_it_shows() -> None:
    """Each template with the fields it uses (StrictUndefined: a missing one fails here, not in prod)."""
    session = Sessions().open(token="t" * 20, tenant=None, now_s=0.0)
    row = _row("ep_x", BreakerState.OPEN, slow=True, p95_ms=2500)
    row = EndpointRow(
        health=row.health.model_copy(update={"consecutive_failures": 1, "status": "paused"}),
        url="https://acme.example/<script>",
        sparkline="0,1 120,2",
    )
    overview = _page(
        "overview.html",
        session,
        summary=[("pending", "3")],
        alerts=[],
        rows=[row],
        total=1,
        tenant="",
        back="/ui/",
    ).body.decode()
    assert "1 failure in a row" in overview
    assert "Resume" in overview  # a paused endpoint offers resume, not pause
    assert "&lt;script&gt;" in overview
    assert "<script>" not in overview
    attempt = {
        "attempt": 1, "kind": "delivery", "at": "2026-11-30T10:00:00Z", "status": 503, "outcome": "retry",
        "error": None, "dns_ms": None, "connect_ms": 1.0, "first_byte_ms": 2.0, "duration_ms": 2.5,
        "dispatcher_id": "d:1", "response_body": "<b>busy</b>",
    }  # fmt: skip
    course = {
        "endpoint_id": "ep_x", "state": "retrying", "attempts": [attempt],
        "next_attempt_at": "2026-11-30T10:00:05Z", "waiting_reason": "in a delay queue",
    }  # fmt: skip
    story = {
        "id": "evt_1", "tenant": "acme", "type": "order.created", "subject": None,
        "accepted_at": "2026-11-30T10:00:00Z", "endpoints": [course],
    }  # fmt: skip
    event = _page("event.html", session, story=story, event_id="evt_1", back="/ui/events/evt_1").body.decode()
    assert "in a delay queue" in event
    assert "&lt;b&gt;busy&lt;/b&gt;" in event
    assert "2026-11-30 10:00:05Z" in event
    events = _page(
        "events.html",
        session,
        events=[story],
        next_after="o5",
        filters={"state": "", "type": "", "subject": "", "after": ""},
        states=("delivered",),
    ).body.decode()
    assert "evt_1" in events
    assert "after=o5" in events
    dead = _page(
        "dead_letters.html",
        session,
        dead_letters=[],
        next_after=None,
        analysis=[],
        filters={"endpoint_id": "", "reason": "", "event_id": "", "after": ""},
        reasons=["permanent_status"],
        back="/ui/dead-letters",
    ).body.decode()
    assert "No dead letters." in dead
    assert session.csrf in overview  # every form carries the session's token
    assert "Log in" in _page("login.html", None).body.decode()
