"""Endpoints through the API and the ``hookline`` command: create, read, change, delete, and their effect."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
from support import services
from support.amqp import event, publish_event, read_stream
from support.logs import logged
from support.receiver import Receiver, Reply
from support.system import System, tenant
from support.system import cli as hookline
from support.waiting import eventually

pytestmark = pytest.mark.e2e


def test_the_cli_manages_endpoints(system: System) -> None:
    acme = tenant()
    created = hookline(
        system,
        "endpoints",
        "add",
        "--tenant",
        acme,
        "--url",
        "http://127.0.0.1:9/a",
        "--event-type",
        "order.*",
        "--event-type",
        "invoice.paid",
        "--description",
        "orders",
    )
    assert created["secret"].startswith("whsec_")
    assert created["event_types"] == ["order.*", "invoice.paid"]
    endpoint_id = created["id"]

    listed = hookline(system, "endpoints", "list", "--tenant", acme)["data"]
    assert [e["id"] for e in listed] == [endpoint_id]
    assert "secret" not in listed[0]
    shown = hookline(system, "endpoints", "show", endpoint_id)
    assert shown["description"] == "orders"
    assert "secret" not in shown
    assert hookline(system, "endpoints", "secret", endpoint_id) == {
        "secret": created["secret"],
        "notify_secret": None,
    }

    updated = hookline(
        system, "endpoints", "update", endpoint_id, "--url", "http://127.0.0.1:9/b", "--timeout-s", "5"
    )
    assert (updated["url"], updated["timeout_s"], updated["event_types"]) == (
        "http://127.0.0.1:9/b",
        5.0,
        ["order.*", "invoice.paid"],
    )
    assert hookline(system, "endpoints", "delete", endpoint_id) == {"deleted": endpoint_id}

    env = {**system.env, "HOOKLINE_INGEST_URL": system.ingest.base_url}
    missing = subprocess.run(
        [services.HOOKLINE, "endpoints", "show", endpoint_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1
    assert f"404 no endpoint {endpoint_id}" in missing.stderr


def test_the_cli_publishes_events(system: System) -> None:
    accepted = hookline(
        system,
        "events",
        "publish",
        "--tenant",
        tenant(),
        "--type",
        "order.created",
        "--data",
        '{"order_id": "o_1"}',
        "--id",
        "evt_cli_1",
    )
    assert accepted["id"] == "evt_cli_1"


async def test_changes_take_effect_on_delivery(system: System, receiver: Receiver) -> None:
    acme = tenant()
    endpoint = system.add_endpoint(acme, receiver.url("/before"), ["order.created"])
    with system.api() as api:
        patched = api.patch(
            f"/v1/endpoints/{endpoint['id']}",
            json={"url": receiver.url("/after"), "event_types": ["invoice.*"], "verify": False},
        )
        assert patched.status_code == 200, patched.text
    # The old pattern no longer routes; the new one does, to the new URL.
    await publish_event(
        system.amqp_url, event(acme, "order.created", "evt_old_pattern"), f"{acme}.order.created"
    )
    await publish_event(
        system.amqp_url, event(acme, "invoice.paid", "evt_new_pattern"), f"{acme}.invoice.paid"
    )
    # A sentinel of the new pattern, published last: the old pattern's event, had it been routed, came first.
    await publish_event(
        system.amqp_url, event(acme, "invoice.sentinel", "evt_sentinel"), f"{acme}.invoice.sentinel"
    )
    delivered = await receiver.wait_for_ids({"evt_new_pattern", "evt_sentinel"}, path="/after")
    delivered = [r for r in delivered if r.headers["webhook-id"] != "evt_sentinel"]
    assert [r.headers["webhook-id"] for r in delivered] == ["evt_new_pattern"]
    assert [r for r in receiver.requests if r.path == "/before"] == []


async def test_deleting_an_endpoint_keeps_its_queued_events_as_dead_letters(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    # Slow enough that the dispatchers' prefetch (2 x 32) cannot drain the queue while we publish.
    receiver.responder = lambda _: Reply(status=204, delay_s=5.0)
    endpoint = system.add_endpoint(acme, receiver.url("/deleted"), ["#"])
    published = [f"evt_del_{n}" for n in range(150)]
    for event_id in published:
        await publish_event(system.amqp_url, event(acme, "a.b", event_id), f"{acme}.a.b")
    await receiver.wait_for(1, path="/deleted")
    with system.api() as api:
        refused = await asyncio.to_thread(api.delete, f"/v1/endpoints/{endpoint['id']}")
        assert refused.status_code == 409, "events are pending: deleting needs force"
        assert refused.json()["error"] == "events_pending"
        forced = await asyncio.to_thread(
            api.delete, f"/v1/endpoints/{endpoint['id']}", params={"force": "true"}
        )
        assert forced.status_code == 204
        assert api.get(f"/v1/endpoints/{endpoint['id']}").status_code == 404
    # Events for the tenant published now are never delivered to it (one published in the moment before
    # its lane has passed the deletion's fence may be kept as a dead letter too: never lost, never sent).
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_after_delete"), f"{acme}.a.b")

    async def accounted() -> tuple[set[str], set[str]] | None:
        delivered = {r.headers["webhook-id"] for r in receiver.requests if r.path == "/deleted"}
        dead = await read_stream(system.amqp_url, "hookline.dead-letters", idle_s=0.3)
        gone = {
            str((m.headers or {}).get("x-hookline-event-id"))
            for m in dead
            if (m.headers or {}).get("x-hookline-endpoint-id") == endpoint["id"]
            and (m.headers or {}).get("x-hookline-reason") == "endpoint_gone"
        }
        return (delivered, gone) if delivered | gone >= set(published) else None

    # Every event is either delivered (those in flight finish) or kept as a dead letter.
    delivered, gone = await eventually(accounted, timeout_s=30)
    assert gone, "some events were still queued when the endpoint was deleted"
    assert "evt_after_delete" not in delivered
    # Past the fence, nothing counts the endpoint any more: a sentinel published now is neither sent to
    # it nor kept for it.
    await eventually(lambda: _drained(system, endpoint["id"]), timeout_s=30)
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_after_fence"), f"{acme}.a.b")
    sentinel = system.add_endpoint(acme, receiver.url("/sentinel"), ["a.b"])
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_sentinel"), f"{acme}.a.b")
    await receiver.wait_for_ids({"evt_sentinel"}, path="/sentinel")
    dead = await read_stream(system.amqp_url, "hookline.dead-letters", idle_s=0.3)
    assert not [
        m for m in dead if (m.headers or {}).get("x-hookline-event-id") in ("evt_after_fence", "evt_sentinel")
    ], "an event published after the fence was kept for the deleted endpoint"
    assert sentinel["id"] != endpoint["id"]


async def _drained(system: System, endpoint_id: str) -> bool:
    """A dispatcher took the deletion's fence out of the endpoint's lane (and said so in the change log)."""
    return bool(logged(system.dispatchers, "endpoint_fence_passed", endpoint_id=endpoint_id))
