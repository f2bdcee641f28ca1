"""Notifications that reach someone: a tenant whose only endpoint is broken hears of it at its notify_url.

With the real services: the breaker opens (endpoint.failing), the warning comes half-way to disabling
(endpoint.disabling), then the endpoint is disabled (endpoint.disabled); another tenant, in Slack's format,
hears of its dead letters and of its endpoint failing, then recovering. Each notification is signed with
the notifier's secret, which the tenant reads with its endpoint's secret; notifications asked for later
(PATCH) work the same.

And (from test_notifiers.py): notifiers are cleaned up, with the real services: one that no endpoint
names any more (a notify_url changed or removed, its endpoint deleted) is removed, while one still named
stays; and naming the URL of a disabled one again (a 410 disabled it) resumes it, so notifications flow
again.

The module runs with both modules' settings: test_notifications.py's, and test_notifiers.py's faster
notifier and queue cleanup (1 s graces, a 0.5 s queue poll, a 0.2 s tick).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook
from support import services
from support.amqp import queue_exists
from support.deliverylog import attempts_at
from support.logs import records
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

from hookline.shared.broker import topology
from hookline.shared.state import notifications

pytestmark = pytest.mark.e2e

SYSTEM_ENV = {
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "3",
    "HOOKLINE_BREAKER_COOLDOWN_S": "1",
    "HOOKLINE_BREAKER_MAX_COOLDOWN_S": "2",
    "HOOKLINE_DISABLE_AFTER_S": "6",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    "HOOKLINE_MAX_ATTEMPTS": "1000",
    # test_notifiers.py's: notifiers and retired queues removed within a second, looked at often.
    "HOOKLINE_NOTIFIER_GRACE_S": "1",
    "HOOKLINE_RETIRED_QUEUE_GRACE_S": "1",
    "HOOKLINE_QUEUE_POLL_S": "0.5",
    "HOOKLINE_TICK_S": "0.2",
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


async def api(system: System, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=30
    ) as client:
        return await client.request(method, path, **kwargs)


async def notifier_urls(system: System) -> set[str]:
    """The URLs of the notifiers registered (endpoints of the operator tenant)."""
    listed = await api(
        system, "GET", "/v1/endpoints", params={"tenant": notifications.OPERATOR_TENANT, "limit": 1000}
    )
    return {notifier["url"] for notifier in listed.json()["data"]}


async def test_a_notifier_no_endpoint_names_is_removed_and_one_still_named_stays(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    shared, moved, dropped = (receiver.url(f"/{acme}/{name}") for name in ("shared", "moved", "dropped"))
    first = system.add_endpoint(acme, receiver.url("/a"), ["#"], notify_url=shared)
    system.add_endpoint(acme, receiver.url("/b"), ["#"], notify_url=shared)
    third = system.add_endpoint(acme, receiver.url("/c"), ["#"], notify_url=moved)
    fourth = system.add_endpoint(acme, receiver.url("/d"), ["#"], notify_url=dropped)
    assert {shared, moved, dropped} <= await notifier_urls(system)
    moved_queue = topology.endpoint_queue(notifications.notifier_id(acme, moved, "event"))

    # The first endpoint stops naming the shared URL (the second still does); the third names another
    # URL; the fourth is deleted.
    assert (
        await api(system, "PATCH", f"/v1/endpoints/{first['id']}", json={"notify_url": None})
    ).status_code == 200
    elsewhere = receiver.url(f"/{acme}/elsewhere")
    patched = await api(system, "PATCH", f"/v1/endpoints/{third['id']}", json={"notify_url": elsewhere})
    assert patched.status_code == 200, patched.text
    assert (await api(system, "DELETE", f"/v1/endpoints/{fourth['id']}")).status_code == 204

    async def cleaned() -> set[str] | None:
        urls = await notifier_urls(system)
        return urls if moved not in urls and dropped not in urls else None

    # Removed in the same monitor poll as the shared one would have been (unnamed earlier): the check
    # that it stays ends with these two gone.
    urls = await eventually(cleaned, timeout_s=30)
    assert shared in urls, "still named by the second endpoint"
    assert elsewhere in urls
    assert "notifier_removed" in system.monitor.log()

    # It cost the broker nothing of its own: delivered from the operator tenant's lane, it never had a
    # queue (a notifier gets one only while it needs isolation, like any endpoint).
    assert not await queue_exists(system.amqp_url, moved_queue)


async def test_naming_a_disabled_notifiers_url_again_resumes_it(system: System, receiver: Receiver) -> None:
    acme = tenant()
    notify_path = f"/{acme}/notify"
    state = {"endpoint": 503, "notify": 410}

    def respond(request: Received) -> Reply:
        return Reply(status=state["notify"] if request.path == notify_path else state["endpoint"])

    receiver.responder = respond
    notify_url = receiver.url(notify_path)
    endpoint = system.add_endpoint(acme, receiver.url(f"/{acme}/endpoint"), ["#"], notify_url=notify_url)
    notifier_id = notifications.notifier_id(acme, notify_url, "event")

    async def notifier_status() -> str:
        return str((await api(system, "GET", f"/v1/endpoints/{notifier_id}")).json()["status"])

    # The breaker opens; the tenant's notify_url answers 410 to endpoint.failing: the notifier is disabled.
    for _ in range(4):
        published = await api(system, "POST", "/v1/events", json={"tenant": acme, "type": "a.b", "data": {}})
        assert published.status_code == 202, published.text

    async def disabled() -> bool:
        return await notifier_status() == "disabled"

    await eventually(disabled, timeout_s=40)

    # The tenant fixes its receiver and sets the same notify_url again: the notifier resumes.
    state["notify"] = 204
    again = await api(system, "PATCH", f"/v1/endpoints/{endpoint['id']}", json={"notify_url": notify_url})
    assert again.status_code == 200, again.text
    assert await notifier_status() == "active", "resumed before the answer"
    assert "notifier_resumed" in system.ingest.log()

    # And it delivers: the endpoint recovers, and its tenant hears of it at the same URL.
    state["endpoint"] = 204

    def told() -> list[str]:
        return [json.loads(r.body)["type"] for r in receiver.requests if r.path == notify_path]

    async def recovered() -> bool:
        return "endpoint.recovered" in told()

    await eventually(recovered, timeout_s=40, explain=lambda: str(told()))
