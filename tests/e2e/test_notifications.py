"""Notifications that reach someone: a tenant whose only endpoint is broken hears of it at its notify_url.

With the real services: the breaker opens (endpoint.failing), the warning comes half-way to disabling
(endpoint.disabling), then the endpoint is disabled (endpoint.disabled); another tenant, in Slack's format,
hears of its dead letters and of its endpoint failing, then recovering. Each notification is signed with
the notifier's secret, which the tenant reads with its endpoint's secret; notifications asked for later
(PATCH) work the same.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from standardwebhooks.webhooks import Webhook
from support import services
from support.deliverylog import attempts_at
from support.logs import records
from support.receiver import Received, Receiver, Reply
from support.system import System
from support.waiting import eventually

pytestmark = pytest.mark.e2e

SYSTEM_ENV = {
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "3",
    "HOOKLINE_BREAKER_COOLDOWN_S": "1",
    "HOOKLINE_BREAKER_MAX_COOLDOWN_S": "2",
    "HOOKLINE_DISABLE_AFTER_S": "6",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    "HOOKLINE_MAX_ATTEMPTS": "1000",
}


async def publish(system: System, tenant: str, count: int = 1) -> None:
    async with httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=30
    ) as api:
        for n in range(count):
            response = await api.post(
                "/v1/events", json={"tenant": tenant, "type": "order.created", "data": {"n": n}}
            )
            assert response.status_code == 202, response.text


def notices(receiver: Receiver, path: str) -> list[Received]:
    return [r for r in receiver.requests if r.path == path]


async def notified(receiver: Receiver, path: str, wanted: str, *, timeout_s: float = 40) -> Received:
    """The first notification of this kind at ``path`` (the event type, or Slack text containing it)."""

    async def arrived() -> Received | None:
        for request in notices(receiver, path):
            body = json.loads(request.body)
            if body.get("type") == wanted or wanted in body.get("text", ""):
                return request
        return None

    return await eventually(arrived, timeout_s=timeout_s, every_s=0.25)


async def test_a_tenant_whose_only_endpoint_is_broken_hears_of_it(system: System, receiver: Receiver) -> None:
    def respond(request: Received) -> Reply:
        return Reply(status=204) if request.path == "/notify" else Reply(status=500)

    receiver.responder = respond
    created = system.add_endpoint(
        "solo", receiver.url("/broken"), ["order.*"], notify_url=receiver.url("/notify")
    )
    notify_secret = created["notify_secret"]
    assert notify_secret.startswith("whsec_")
    with system.api() as api:
        secrets = (await asyncio.to_thread(api.get, f"/v1/endpoints/{created['id']}/secret")).json()
    assert secrets["notify_secret"] == notify_secret
    assert created["notify_url"] == receiver.url("/notify")

    await publish(system, "solo", 4)
    failing = await notified(receiver, "/notify", "endpoint.failing")
    event = Webhook(notify_secret).verify(failing.body, failing.headers)  # signed like every webhook
    assert event["type"] == "endpoint.failing"
    assert event["tenant"] == "hookline"  # delivered under the operator tenant...
    assert event["data"]["tenant"] == "solo"  # ...about this tenant's endpoint
    assert event["data"]["endpoint_id"] == created["id"]
    assert event["subject"] == created["id"]
    assert "circuit breaker" in event["data"]["detail"]

    # Still failing: warned half-way, then disabled, and told each time.
    warning = json.loads((await notified(receiver, "/notify", "endpoint.disabling")).body)
    assert "disabled at" in warning["data"]["detail"]
    disabled = json.loads((await notified(receiver, "/notify", "endpoint.disabled")).body)
    assert disabled["data"]["endpoint_id"] == created["id"]
    assert disabled["data"]["status"] == "disabled"
    with system.api() as api:
        assert (await asyncio.to_thread(api.get, f"/v1/endpoints/{created['id']}")).json()[
            "status"
        ] == "disabled"

    # Each kind once: the alert book de-duplicates (counted by id: under at-least-once a notification
    # may come twice). Two dispatchers serve the notifier: two notifications queued together may cross.
    told = {r.headers["webhook-id"]: json.loads(r.body)["type"] for r in notices(receiver, "/notify")}
    assert sorted(told.values()) == ["endpoint.disabled", "endpoint.disabling", "endpoint.failing"]

    # The monitor disabled the endpoint before it closed the breaker: closed first, the dispatchers
    # resumed the queue for a moment, and the attempts they made opened the breaker of the disabled
    # endpoint again, which told the tenant endpoint.failing once more (issue 23).
    async def decided() -> list[str] | None:
        order = [
            line["event"] if line["event"] == "endpoint_disabled" else line["state"]
            for line in records(system.monitor)
            if line.get("endpoint_id") == created["id"]
            and line["event"] in ("endpoint_disabled", "breaker_changed")
        ]
        return order if {"endpoint_disabled", "closed"} <= set(order) else None

    order = await eventually(decided)
    assert order.index("endpoint_disabled") < order.index("closed"), f"closed before disabled: {order}"

    # The notifier is an endpoint of the operator tenant: its attempts reach the delivery log (which
    # follows the telemetry stream, so a moment later). Those notifications and no other, each
    # delivered on its first try (counted by id: under at-least-once a copy may come again).
    with system.api() as api:
        notifiers = (await asyncio.to_thread(api.get, "/v1/endpoints", params={"tenant": "hookline"})).json()
        [notifier] = [n for n in notifiers["data"] if n["url"] == receiver.url("/notify")]
    attempts = await attempts_at(system, notifier["id"], at_least=len(told))
    assert {a["event_id"] for a in attempts} == set(told), attempts
    assert {(a["attempt"], a["status"]) for a in attempts} == {(1, 204)}, attempts


async def test_slack_format_dead_letters_failing_and_recovered(system: System, receiver: Receiver) -> None:
    mode = {"status": 400}

    def respond(request: Received) -> Reply:
        return Reply(status=200) if request.path == "/slack" else Reply(status=mode["status"])

    receiver.responder = respond
    created = system.add_endpoint("mend", receiver.url("/mend"), ["order.*"])
    assert created["notify_secret"] is None
    with system.api() as api:  # notifications asked for later, in Slack's format
        changed = await asyncio.to_thread(
            api.patch,
            f"/v1/endpoints/{created['id']}",
            json={"notify_url": receiver.url("/slack"), "notify_format": "slack"},
        )
        assert changed.status_code == 200, changed.text
        notify_secret = (await asyncio.to_thread(api.get, f"/v1/endpoints/{created['id']}/secret")).json()[
            "notify_secret"
        ]
    await publish(system, "mend")  # refused for good: a dead letter
    growing = await notified(receiver, "/slack", "dead_letters.growing")
    assert set(json.loads(growing.body)) == {"text"}  # what a Slack incoming webhook takes
    assert created["id"] in json.loads(growing.body)["text"]
    Webhook(notify_secret).verify(growing.body, growing.headers)

    mode["status"] = 503
    await publish(system, "mend", 4)
    await notified(receiver, "/slack", "endpoint.failing")
    mode["status"] = 200  # the receiver is fixed: a probe succeeds, the breaker closes
    recovered = await notified(receiver, "/slack", "endpoint.recovered")
    assert "mend" in json.loads(recovered.body)["text"]
