"""Tenant notifications: who delivers them, which alert transition sends what, and the Slack body."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import orjson
import pytest

from hookline.health_monitor.alerts import AlertPolicy, _failing
from hookline.health_monitor.breaker import Breaker
from hookline.health_monitor.health import EndpointHealth
from hookline.shared.contracts.control import BreakerState
from hookline.shared.contracts.models import EndpointStatus, Event, SigningSecret, StoredEndpoint
from hookline.shared.state.notifications import (
    OPERATOR_TENANT,
    Notice,
    notice_for,
    notification,
    notifier_id,
    notifier_of,
    render,
    unnamed_notifiers,
)

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def endpoint(**fields: object) -> StoredEndpoint:
    base: dict[str, object] = {
        "id": "ep_01JD0000000000000000000001",
        "tenant": "acme",
        "url": "https://acme.example/hooks",
        "event_types": ["order.*"],
        "created_at": NOW,
        "updated_at": NOW,
        "secrets": [SigningSecret(value="whsec_" + "A" * 32, created_at=NOW)],
        "notify_url": "https://ops.acme.example/hookline",
    }
    return StoredEndpoint.model_validate(base | fields)


def test_a_notifier_id_is_a_valid_endpoint_id_derived_from_tenant_url_and_format() -> None:
    first = notifier_id("acme", "https://ops.acme.example/h", "event")
    assert re.fullmatch(r"ep_[0-9A-Z]{26}", first)
    assert first == notifier_id("acme", "https://ops.acme.example/h", "event")  # every replica agrees
    others = {
        notifier_id("globex", "https://ops.acme.example/h", "event"),
        notifier_id("acme", "https://ops.acme.example/other", "event"),
        notifier_id("acme", "https://ops.acme.example/h", "slack"),
    }
    assert first not in others
    assert len(others) == 3
    assert notifier_of(endpoint()) == notifier_id("acme", "https://ops.acme.example/hookline", "event")
    assert notifier_of(endpoint(notify_url=None)) is None


@pytest.mark.parametrize(
    ("alert", "state", "fields", "expected"),
    [
        ("breaker_open", "firing", {}, Notice.FAILING),
        ("breaker_open", "resolved", {}, Notice.RECOVERED),
        ("breaker_open", "resolved", {"status": EndpointStatus.DISABLED}, None),  # disabled: no recovery
        ("breaker_open", "resolved", {"status": EndpointStatus.PAUSED}, None),
        ("endpoint_disabling", "firing", {}, Notice.DISABLING),
        ("endpoint_disabling", "resolved", {}, None),
        ("endpoint_disabled", "firing", {"status": EndpointStatus.DISABLED}, Notice.DISABLED),
        ("dead_letters_growing", "firing", {}, Notice.DEAD_LETTERS_GROWING),
        ("dead_letters_growing", "resolved", {}, None),
        ("slow_endpoint", "firing", {}, None),
        ("breaker_open", "firing", {"notify_url": None}, None),  # nobody asked
    ],
)
def test_which_alert_transition_tells_the_tenant_what(
    alert: str, state: str, fields: dict[str, object], expected: Notice | None
) -> None:
    assert notice_for(alert, state, endpoint(**fields)) is expected


def test_no_endpoint_no_notice() -> None:
    assert notice_for("breaker_open", "firing", None) is None


def test_a_notification_is_an_event_of_the_operator_tenant_about_the_endpoint() -> None:
    event = notification(Notice.FAILING, endpoint(), "circuit breaker open after 10 failures", now=NOW)
    assert Event.model_validate_json(event.model_dump_json()) == event  # what a dispatcher accepts
    assert (event.tenant, event.type, event.subject) == (OPERATOR_TENANT, "endpoint.failing", endpoint().id)
    assert event.data["tenant"] == "acme"
    assert event.data["endpoint_id"] == endpoint().id
    assert event.data["detail"] == "circuit breaker open after 10 failures"
    assert "endpoint.failing" in event.data["text"]
    assert endpoint().id in event.data["text"]


@pytest.mark.parametrize(
    ("body_format", "event", "expected"),
    [
        ("event", {"type": "a.b", "data": {"x": 1}}, {"type": "a.b", "data": {"x": 1}}),
        ("slack", {"type": "a.b", "data": {"text": "hello", "x": 1}}, {"text": "hello"}),
        ("slack", {"type": "a.b", "data": {"x": 1}}, {"text": 'a.b: {"x":1}'}),
        ("slack", {"type": "a.b", "data": {"text": 5}}, {"text": 'a.b: {"text":5}'}),
    ],
)
def test_render(body_format: str, event: dict[str, object], expected: dict[str, object]) -> None:
    assert orjson.loads(render(body_format, orjson.dumps(event))) == expected  # type: ignore[arg-type]


def _open_for(seconds: float, status: EndpointStatus = EndpointStatus.ACTIVE) -> list[str]:
    now_s = 1_000_000.0
    health = EndpointHealth()
    health.breaker = Breaker(BreakerState.OPEN, 10, now_s - 1, now_s - seconds, 300)
    policy = AlertPolicy(disable_after_s=3600)
    return [name for name, _ in _failing(endpoint(status=status), health, now_s=now_s, policy=policy)]


@pytest.mark.parametrize(
    ("open_s", "status", "expected"),
    [
        (60, EndpointStatus.ACTIVE, ["breaker_open"]),
        (1799, EndpointStatus.ACTIVE, ["breaker_open"]),
        (1800, EndpointStatus.ACTIVE, ["breaker_open", "endpoint_disabling"]),  # half-way: the warning
        (1800, EndpointStatus.PAUSED, ["breaker_open"]),
    ],
)
def test_the_disable_warning_comes_half_way(
    open_s: float, status: EndpointStatus, expected: list[str]
) -> None:
    assert _open_for(open_s, status) == expected


def test_a_closed_breaker_is_no_alert() -> None:
    assert _failing(endpoint(), EndpointHealth(), now_s=0.0, policy=AlertPolicy()) == []


def notifier_for(tenant: str, url: str, body_format: str = "event") -> StoredEndpoint:
    return endpoint(
        id=notifier_id(tenant, url, body_format),
        tenant=OPERATOR_TENANT,
        url=url,
        event_types=["hookline.notification"],
        notify_url=None,
    )


def test_a_notifier_is_unnamed_once_no_endpoint_names_its_tenant_url_and_format() -> None:
    shared_url, own_url = "https://ops.acme.example/a", "https://ops.acme.example/b"
    shared, own = notifier_for("acme", shared_url), notifier_for("acme", own_url)
    slack = notifier_for("acme", shared_url, "slack")
    other_tenants = notifier_for("globex", shared_url)
    first = endpoint(id="ep_01JD0000000000000000000001", notify_url=shared_url)
    second = endpoint(id="ep_01JD0000000000000000000002", notify_url=shared_url)
    third = endpoint(id="ep_01JD0000000000000000000003", notify_url=own_url, notify_format="slack")
    notifiers = [shared, own, slack, other_tenants]

    def unnamed(*endpoints: StoredEndpoint) -> set[str]:
        named = {notifier_of(e) for e in endpoints}  # what the registry's notifier index answers
        return {n.id for n in unnamed_notifiers(notifiers, named.__contains__)}

    # The second endpoint still names the shared one; the third names its URL in another format.
    assert unnamed(first, second, third) == {own.id, slack.id, other_tenants.id}
    assert unnamed(second) == {own.id, slack.id, other_tenants.id}
    assert unnamed(first.model_copy(update={"notify_url": None})) == {n.id for n in notifiers}
    assert unnamed() == {n.id for n in notifiers}, "every endpoint deleted"
    assert unnamed_notifiers([], {notifier_of(first)}.__contains__) == [], "no notifier, nothing to remove"
