"""An event's whole path: ingest or AMQP → ``events`` → endpoint queue → dispatcher → signed POST; and
what the path refuses: garbage published to AMQP, dead-lettered by the dispatcher with the reason
(from test_bad_input.py), and the event-type catalog's validation off, warn or enforce (a 422 naming the
JSON pointer over HTTP, an ``invalid_event`` dead letter naming it over AMQP; from test_event_types.py).
The API refusals and the catalog's management are integration tests (tests/integration/test_bad_input.py,
test_event_type_catalog.py).

And (from test_endpoints.py) endpoints through the API and the ``hookline`` command: create, read,
change, delete, and their effect on delivery."""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook
from support import services
from support.amqp import event, publish_event, read_stream
from support.logs import logged
from support.receiver import Receiver, Reply
from support.system import System, tenant
from support.system import cli as hookline
from support.waiting import eventually

pytestmark = pytest.mark.e2e


async def test_events_reach_exactly_the_subscribed_endpoints_signed(
    system: System, receiver: Receiver
) -> None:
    acme, other = tenant(), tenant()
    orders = system.add_endpoint(acme, receiver.url("/orders"), ["order.*"])
    system.add_endpoint(acme, receiver.url("/invoices"), ["invoice.#"])
    system.add_endpoint(other, receiver.url("/foreign"), ["order.*"])

    # Published straight to AMQP, as an upstream system would.
    direct = event(acme, "order.created", "evt_direct_1", order_id="o_1", total=4200)
    direct_body = json.dumps(direct).encode()
    await publish_event(system.amqp_url, direct_body, f"{acme}.order.created", message_id="evt_direct_1")
    # Published through the API: the id is assigned, and 202 comes after the broker's confirm.
    with system.api() as api:
        answer = api.post(
            "/v1/events", json={"tenant": acme, "type": "order.updated", "data": {"order_id": "o_1"}}
        )
    assert answer.status_code == 202, answer.text
    api_id = answer.json()["id"]
    assert api_id.startswith("evt_")
    # Nobody subscribes to these: another tenant's invoice, and our tenant's shipment.
    await publish_event(system.amqp_url, event(other, "invoice.paid", "evt_x1"), f"{other}.invoice.paid")
    await publish_event(system.amqp_url, event(acme, "shipment.sent", "evt_x2"), f"{acme}.shipment.sent")
    # Sentinels, one per endpoint, published last: once each has arrived, anything misrouted to its
    # queue before it would have too.
    sentinels = {
        "/foreign": "evt_sentinel",
        "/orders": "evt_sentinel_orders",
        "/invoices": "evt_sentinel_invoices",
    }
    for who, event_type, event_id in (
        (other, "order.created", sentinels["/foreign"]),
        (acme, "order.sentinel", sentinels["/orders"]),
        (acme, "invoice.sentinel", sentinels["/invoices"]),
    ):
        await publish_event(system.amqp_url, event(who, event_type, event_id), f"{who}.{event_type}")
    await receiver.wait_for_ids({"evt_direct_1", api_id, sentinels["/orders"]}, path="/orders")
    for path in ("/foreign", "/invoices"):
        await receiver.wait_for_ids({sentinels[path]}, path=path)
    delivered = [
        r
        for r in receiver.requests
        if r.path == "/orders" and r.headers["webhook-id"] != sentinels["/orders"]
    ]

    by_id = {request.headers["webhook-id"]: request for request in delivered}
    assert set(by_id) == {"evt_direct_1", api_id}
    assert by_id["evt_direct_1"].body == direct_body, "the body is delivered byte for byte"
    assert json.loads(by_id[api_id].body)["data"] == {"order_id": "o_1"}
    for request in delivered:
        # A receiver using the standardwebhooks library verifies the delivery unchanged.
        Webhook(orders["secret"]).verify(request.body, request.headers)
        assert request.headers["content-type"] == "application/json"
        assert request.headers["user-agent"].startswith("hookline/")
    assert [r.headers["webhook-id"] for r in receiver.requests if r.path == "/foreign"] == ["evt_sentinel"]
    assert [r.headers["webhook-id"] for r in receiver.requests if r.path == "/invoices"] == [
        sentinels["/invoices"]
    ]
    assert len(receiver.requests) == 2 + len(sentinels)


async def test_each_attempt_logs_one_canonical_line_without_payload(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    endpoint = system.add_endpoint(acme, receiver.url("/logged"), ["order.created"])
    secret_marker = "PAYLOAD-MARKER-93f1"
    await publish_event(
        system.amqp_url,
        event(acme, "order.created", "evt_logged_1", note=secret_marker),
        f"{acme}.order.created",
    )
    await receiver.wait_for(1, path="/logged")

    def logged_attempts() -> list[dict[str, object]]:
        lines = [json.loads(line) for line in system.logs().splitlines() if line.startswith("{")]
        return [
            line
            for line in lines
            if line.get("event") == "delivery_attempt" and line.get("event_id") == "evt_logged_1"
        ]

    # The log line is written after the response (an empty list is "not yet": eventually wants None).
    attempts = await eventually(lambda: asyncio.to_thread(lambda: logged_attempts() or None))
    assert len(attempts) == 1
    line = attempts[0]
    assert line["endpoint_id"] == endpoint["id"]
    assert (line["tenant"], line["type"], line["attempt"], line["status"], line["outcome"]) == (
        acme,
        "order.created",
        1,
        204,
        "success",
    )
    assert line["duration_ms"] > 0
    assert {"dns_ms", "connect_ms", "first_byte_ms"} <= set(line)
    assert secret_marker not in system.logs()
    assert endpoint["secret"] not in system.logs()


async def test_a_dispatcher_started_later_knows_every_endpoint(system: System, receiver: Receiver) -> None:
    acme = tenant()
    system.add_endpoint(acme, receiver.url("/late"), ["#"])
    # Stop both replicas; events wait in the endpoint's queue.
    for dispatcher in system.dispatchers:
        assert dispatcher.stop() == 0
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_late_1"), f"{acme}.a.b")

    # With no dispatcher, the event waits: the delivery log has it, pending, and nothing arrived.
    def pending() -> bool:
        with system.api() as api:
            answer = api.get("/v1/events/evt_late_1")
        return answer.status_code == 200 and [e["state"] for e in answer.json()["endpoints"]] == ["pending"]

    await eventually(lambda: asyncio.to_thread(pending))
    assert receiver.requests == []
    # A new replica replays the endpoint log, finds the endpoint and delivers what waited.
    system.start_dispatcher("dispatcher-late")
    delivered = await receiver.wait_for(1, path="/late")
    assert delivered[0].headers["webhook-id"] == "evt_late_1"


GARBAGE = [
    ("not-json", b"this is not json", {}),
    (
        "wrong-type",
        json.dumps({"id": "evt_g2", "type": 5, "tenant": "T", "occurred_at": "x", "data": 1}).encode(),
        {},
    ),
    ("no-message-id", None, {"message_id": None}),
    ("wrong-content-type", None, {"content_type": "text/plain"}),
    ("huge", b'{"blob": "' + b"x" * 400_000 + b'"}', {}),
    ("unicode", '{"id": "evt_\u202e\U0001f4a5", "type": "order.created"}'.encode(), {}),
]


async def test_garbage_published_to_amqp_is_dead_lettered_with_the_reason(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    endpoint = system.add_endpoint(acme, receiver.url("/garbage"), ["order.*"])
    for label, body, properties in GARBAGE:
        valid = event(acme, "order.created", f"evt_{label}")
        payload = json.dumps(valid).encode() if body is None else body
        props = {"message_id": f"evt_{label}", **properties}
        await publish_event(system.amqp_url, payload, f"{acme}.order.created", **props)
    # The dispatchers keep running: a valid event published afterwards is delivered.
    await publish_event(
        system.amqp_url, event(acme, "order.created", "evt_after_garbage"), f"{acme}.order.created"
    )
    delivered = await receiver.wait_for(1, path="/garbage")
    assert [r.headers["webhook-id"] for r in delivered] == ["evt_after_garbage"]

    dead = await read_stream(system.amqp_url, "hookline.dead-letters", at_least=len(GARBAGE))
    mine = [m for m in dead if (m.headers or {}).get("x-hookline-endpoint-id") == endpoint["id"]]
    assert len(mine) == len(GARBAGE)
    reasons = {m.message_id: m.headers for m in mine}
    assert all(headers["x-hookline-reason"] == "invalid_event" for headers in reasons.values())
    by_error = sorted(str(headers["x-hookline-last-error"]) for headers in reasons.values())
    for expected in (
        "Invalid JSON",
        "type: Input should be a valid string",
        "differs from the body's id",  # aio-pika fills in a random message_id; unit tests cover None
        "content_type must be application/json",
        "over the limit",
        "id: String should match pattern",
    ):
        assert any(expected in error for error in by_error), (expected, by_error)
    # The original bytes are kept for inspection.
    assert any(m.body == b"this is not json" for m in mine)

    def invalid_lines() -> list[dict[str, object]]:
        return [
            line
            for line in (json.loads(raw) for raw in system.logs().splitlines() if raw.startswith("{"))
            if line.get("event") == "event_invalid" and line.get("endpoint_id") == endpoint["id"]
        ]

    # Logged as each is dead-lettered: all there once the dead letters are.
    await eventually(lambda: asyncio.to_thread(lambda: len(invalid_lines()) >= len(GARBAGE)))
    assert len(invalid_lines()) == len(GARBAGE), "each invalid message is logged once"


PAYMENT_SCHEMA = {
    "type": "object",
    "required": ["payment_id", "amount"],
    "properties": {"payment_id": {"type": "string"}, "amount": {"type": "integer", "minimum": 1}},
}


def api_client(system: System, token: str = services.TOKEN) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {token}"}, timeout=30
    )


def typed_event(
    acme: str, event_type: str, event_id: str, data: dict[str, Any], **fields: Any
) -> dict[str, Any]:
    return {
        "id": event_id,
        "tenant": acme,
        "type": event_type,
        "occurred_at": "2026-12-01T00:00:00Z",
        "data": data,
        **fields,
    }


def arrived(receiver: Receiver, path: str) -> list[str]:
    return [json.loads(r.body)["id"] for r in receiver.requests if r.path == path]


async def test_validation_off_warn_and_enforce(system: System, receiver: Receiver) -> None:
    acme = tenant()
    async with api_client(system) as api:
        created = await api.post(
            "/v1/event-types",
            json={"name": "payment.captured", "description": "A payment was captured.", "schemas": {"1": PAYMENT_SCHEMA},
                  "examples": [{"payment_id": "p_1", "amount": 100}], "validation": "enforce"},
        )  # fmt: skip
        assert created.status_code == 201, created.text
        assert created.headers["etag"] == '"1"'
        again = await api.post("/v1/event-types", json={"name": "payment.captured"})
        assert again.status_code == 409, again.text
    system.add_endpoint(acme, receiver.url("/payments"), ["payment.*"])

    async with api_client(system) as api:
        good = await api.post(
            "/v1/events",
            json=typed_event(acme, "payment.captured", f"evt_ok_{acme}", {"payment_id": "p", "amount": 5}),
        )
        bad = await api.post(
            "/v1/events",
            json=typed_event(acme, "payment.captured", f"evt_bad_{acme}", {"payment_id": "p", "amount": 0}),
        )
        old = await api.post(
            "/v1/events", json=typed_event(acme, "payment.captured", f"evt_v2_{acme}", {}, schema_version=2)
        )
    assert good.status_code == 202, good.text
    assert good.json()["warnings"] == []
    assert bad.status_code == 422, bad.text
    assert bad.json()["error"] == "invalid_event"
    assert [d["field"] for d in bad.json()["details"]] == ["/data/amount"]
    assert old.status_code == 422, old.text
    assert [d["field"] for d in old.json()["details"]] == ["/schema_version"]

    # warn (and deprecated): accepted, and the answer says what is wrong; the log names the place only.
    async with api_client(system) as api:
        changed = await api.patch(
            "/v1/event-types/payment.captured",
            json={"validation": "warn", "deprecated": True},
            headers={"if-match": '"1"'},
        )
        assert changed.status_code == 200, changed.text
        stale = await api.patch(
            "/v1/event-types/payment.captured", json={"validation": "off"}, headers={"if-match": '"1"'}
        )
        assert stale.status_code == 409, stale.text
        warned = await api.post(
            "/v1/events",
            json=typed_event(
                acme, "payment.captured", f"evt_warned_{acme}", {"payment_id": "p", "amount": "lots"}
            ),
        )
    assert warned.status_code == 202, warned.text
    warnings = warned.json()["warnings"]
    assert any("/data/amount" in w for w in warnings), warnings
    assert any("deprecated" in w for w in warnings), warnings
    assert "lots" not in system.ingest.log()

    await eventually(
        lambda: asyncio.sleep(
            0, {f"evt_ok_{acme}", f"evt_warned_{acme}"} <= set(arrived(receiver, "/payments"))
        )
    )
    assert f"evt_bad_{acme}" not in arrived(receiver, "/payments")


async def test_an_event_published_over_amqp_that_breaks_an_enforced_schema_is_dead_lettered_naming_the_place(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    async with api_client(system) as api:
        created = await api.post(
            "/v1/event-types",
            json={"name": "refund.issued", "schemas": {"1": PAYMENT_SCHEMA}, "validation": "enforce"},
        )
        assert created.status_code == 201, created.text
    endpoint = system.add_endpoint(acme, receiver.url("/refunds"), ["refund.*"])
    await publish_event(
        system.amqp_url,
        typed_event(acme, "refund.issued", f"evt_amqp_bad_{acme}", {"payment_id": 7, "amount": 1}),
        f"{acme}.refund.issued",
    )
    await publish_event(
        system.amqp_url,
        typed_event(acme, "refund.issued", f"evt_amqp_ok_{acme}", {"payment_id": "p", "amount": 1}),
        f"{acme}.refund.issued",
    )

    async def dead() -> list[dict[str, Any]] | None:
        async with api_client(system) as api:
            page = (await api.get("/v1/dead-letters", params={"endpoint_id": endpoint["id"]})).json()
        return page["data"] or None

    [letter] = await eventually(dead)
    assert letter["event_id"] == f"evt_amqp_bad_{acme}"
    assert letter["reason"] == "invalid_event"
    assert "/data/payment_id" in letter["last_error"]
    await eventually(lambda: asyncio.sleep(0, f"evt_amqp_ok_{acme}" in arrived(receiver, "/refunds")))
    assert f"evt_amqp_bad_{acme}" not in arrived(receiver, "/refunds")


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
    """A dispatcher took the deletion's fence out of the endpoint's lane (and said so in the change log):
    one of the module's two, or one a test started later (``system.extra``)."""
    every = [*system.dispatchers, *system.extra]
    return bool(logged(every, "endpoint_fence_passed", endpoint_id=endpoint_id))
