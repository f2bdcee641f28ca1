"""Notifiers are cleaned up, with the real services: one that no endpoint names any more (a notify_url
changed or removed, its endpoint deleted) is removed, while one still named stays; and
naming the URL of a disabled one again (a 410 disabled it) resumes it, so notifications flow again."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from support import services
from support.amqp import queue_exists
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

from hookline.shared.broker import topology
from hookline.shared.state import notifications

pytestmark = pytest.mark.e2e

SYSTEM_ENV = {
    "HOOKLINE_NOTIFIER_GRACE_S": "1",
    "HOOKLINE_RETIRED_QUEUE_GRACE_S": "1",
    "HOOKLINE_QUEUE_POLL_S": "0.5",
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "3",
    "HOOKLINE_BREAKER_COOLDOWN_S": "1",
    "HOOKLINE_BREAKER_MAX_COOLDOWN_S": "2",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    "HOOKLINE_MAX_ATTEMPTS": "1000",
}


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
