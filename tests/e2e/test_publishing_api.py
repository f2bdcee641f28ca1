"""The two ends of a webhook with the real services: the publisher's and the receiver's.

Publishing through the API as an upstream team integrates it. Idempotent: an event id (or an
Idempotency-Key) accepted once is answered 200 ``duplicate`` afterwards, on another ingest replica and
after a restart, and is delivered once; the same key with another request is refused. In batches: up to
500 events in one request, a result per item, a bad item refused alone.

And (from test_receiver_library.py): hookline.receiver as a customer runs it: a FastAPI app on 127.0.0.1
(uvicorn, in this process) is the endpoint of real deliveries from the running system. Each event's
handler runs once, including one whose handler failed once (answered 500, retried by hookline); a
captured delivery replayed byte for byte and hookline's own resend (same webhook-id, new signature) are
answered 2xx without running the handler; a forged or tampered request is refused 401 and runs nothing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from support import services
from support.logs import logged
from support.receiver import Receiver
from support.receiver_apps import fastapi_app
from support.system import System, tenant
from support.waiting import eventually

from hookline.receiver import Delivery, SQLiteStore
from hookline.shared.contracts.ids import id_time_s
from hookline.shared.outbound import signing

pytestmark = pytest.mark.e2e


def client(base_url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=30
    )


async def post(base_url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    async with client(base_url) as api:
        return await api.post("/v1/events", json=body, headers=headers)


def deliveries(receiver: Receiver, path: str) -> Counter[str]:
    """How many times each event id arrived at ``path``."""
    return Counter(json.loads(r.body)["id"] for r in receiver.requests if r.path == path)


async def sentinel_arrives(system: System, receiver: Receiver, acme: str, path: str) -> None:
    """Published last: once it is in, whatever was published before it would have arrived too."""
    sent = await post(
        system.ingest.base_url,
        {"id": f"evt_sentinel_{acme}", "tenant": acme, "type": "order.sentinel", "data": {}},
    )
    assert sent.status_code == 202, sent.text
    await eventually(lambda: asyncio.sleep(0, deliveries(receiver, path)[f"evt_sentinel_{acme}"] >= 1))


async def logged_by(base_url: str, event_id: str) -> bool:
    """The replica's delivery log has the event (it follows the event log stream)."""
    async with client(base_url) as api:
        return (await api.get(f"/v1/events/{event_id}")).status_code == 200


async def test_an_event_id_is_accepted_once_across_replicas_and_a_restart(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    system.add_endpoint(acme, receiver.url("/once"), ["order.*"])
    event_id = f"evt_retried_{acme}"
    body = {"id": event_id, "tenant": acme, "type": "order.created", "data": {"n": 1}}

    first = await post(system.ingest.base_url, body)
    assert first.status_code == 202, first.text
    accepted = first.json()
    assert accepted["duplicate"] is False

    # A retry, even one whose body changed: the event is the tenant and its id.
    again = await post(system.ingest.base_url, {**body, "type": "order.changed", "data": {"n": 2}})
    assert again.status_code == 200, again.text
    assert again.json() == {
        "id": event_id, "tenant": acme, "type": "order.created",
        "accepted_at": accepted["accepted_at"], "duplicate": True, "warnings": [],
    }  # fmt: skip
    # Another tenant's event with the same id is another event.
    other = await post(system.ingest.base_url, {**body, "tenant": tenant()})
    assert other.status_code == 202, other.text

    # A second ingest replica knows it once its delivery log has followed the event log to it.
    second = services.start("ingest", system.env, system.log_dir, name="ingest-second")
    system.extra.append(second)
    second.wait_ready()
    await eventually(lambda: logged_by(second.base_url, event_id))
    on_second = await post(second.base_url, body)
    assert on_second.status_code == 200, on_second.text
    assert on_second.json()["accepted_at"] == accepted["accepted_at"]

    # Restarted on its port (its delivery log on disk), the first replica knows it at once.
    assert system.ingest.stop() == 0
    system.ingest = services.Service(
        "ingest", {**system.env, "HOOKLINE_INGEST_PORT": str(system.ingest.port)}, system.log_dir,
        port=system.ingest.port, name="ingest-restarted",
    )  # fmt: skip
    system.extra.append(system.ingest)  # stopped with the others at the end
    system.ingest.wait_ready()
    after_restart = await post(system.ingest.base_url, body)
    assert after_restart.status_code == 200, after_restart.text
    assert after_restart.json()["duplicate"] is True

    await sentinel_arrives(system, receiver, acme, "/once")
    assert deliveries(receiver, "/once")[event_id] == 1


async def test_an_idempotency_key_names_one_event(system: System, receiver: Receiver) -> None:
    acme = tenant()
    system.add_endpoint(acme, receiver.url("/keyed"), ["order.*"])
    body = {"tenant": acme, "type": "order.paid", "data": {"order_id": "o_1", "amount": 1200}}

    # Five attempts at once (a client that timed out and retried, several times): one is published.
    answers = await asyncio.gather(
        *(post(system.ingest.base_url, body, **{"Idempotency-Key": "pay-o_1"}) for _ in range(5))
    )
    assert sorted(a.status_code for a in answers) == [200, 200, 200, 200, 202], [a.text for a in answers]
    ids = {a.json()["id"] for a in answers}
    assert len(ids) == 1
    [event_id] = ids
    assert event_id.startswith("evt_")
    assert id_time_s(event_id) is None

    # The same key with another request is a mistake worth saying so.
    changed = await post(
        system.ingest.base_url,
        {**body, "data": {"order_id": "o_1", "amount": 99}},
        **{"Idempotency-Key": "pay-o_1"},
    )
    assert changed.status_code == 422, changed.text
    assert changed.json()["error"] == "idempotency_key_reused"
    # Keys are per tenant, and a key that is no key is refused.
    elsewhere = await post(
        system.ingest.base_url, {**body, "tenant": tenant()}, **{"Idempotency-Key": "pay-o_1"}
    )
    assert elsewhere.status_code == 202
    assert elsewhere.json()["id"] != event_id
    too_long = await post(system.ingest.base_url, body, **{"Idempotency-Key": "k" * 256})
    assert too_long.status_code == 422, too_long.text
    assert too_long.json()["error"] == "invalid_idempotency_key"

    # A retry once the event is in the delivery log (and delivered) is still the same event.
    await eventually(lambda: logged_by(system.ingest.base_url, event_id))
    later = await post(system.ingest.base_url, body, **{"Idempotency-Key": "pay-o_1"})
    assert later.status_code == 200
    assert later.json()["id"] == event_id

    await sentinel_arrives(system, receiver, acme, "/keyed")
    assert deliveries(receiver, "/keyed")[event_id] == 1


async def test_the_cli_publishes_with_an_idempotency_key(system: System) -> None:
    env = {**system.env, "HOOKLINE_INGEST_URL": system.ingest.base_url}
    command = [
        services.HOOKLINE, "events", "publish", "--tenant", tenant(), "--type", "order.created",
        "--data", '{"n": 1}', "--idempotency-key", "cli-1",
    ]  # fmt: skip
    answers = []
    for _ in range(2):
        done = await asyncio.to_thread(
            subprocess.run, command, env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        answers.append(json.loads(done.stdout))
    assert [a["duplicate"] for a in answers] == [False, True]
    assert answers[0]["id"] == answers[1]["id"]


async def test_a_batch_gets_a_result_per_item_and_each_event_is_delivered_once(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    system.add_endpoint(acme, receiver.url("/batch"), ["order.*"])
    # Alone in its tenant, the endpoint could be routed straight to a queue of its own during the 500
    # below (backlogged), and a handful of events published during that switch reach it both ways (at
    # least once: tests/integration/test_direct_routes.py). One naming an overlapping pattern keeps its
    # events in its lane, so that a second delivery here can only be a second publish.
    system.add_endpoint(acme, receiver.url("/beside"), ["order.#"])
    earlier = await post(
        system.ingest.base_url,
        {"id": f"evt_earlier_{acme}", "tenant": acme, "type": "order.created", "data": {}},
    )
    assert earlier.status_code == 202, earlier.text
    big = "x" * 200_000  # three of these are over HOOKLINE_MAX_PAYLOAD_BYTES, not over the batch limit
    items: list[dict[str, Any]] = [
        {"id": f"evt_b1_{acme}", "tenant": acme, "type": "order.created", "data": {"blob": big}},
        {"id": f"evt_earlier_{acme}", "tenant": acme, "type": "order.created", "data": {}},
        {"tenant": acme, "type": "Not A Type", "data": {}},
        {"id": f"evt_b2_{acme}", "tenant": acme, "type": "order.created", "data": {"blob": big}},
        {"id": f"evt_b2_{acme}", "tenant": acme, "type": "order.created", "data": {"blob": big}},
        {"tenant": "hookline", "type": "order.created", "data": {}},
        {"tenant": acme, "type": "order.created", "data": {"blob": big}},
    ]
    async with client(system.ingest.base_url) as api:
        answer = await api.post("/v1/events/batch", json={"events": items})
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert [r["index"] for r in results] == list(range(len(items)))
    statuses = [r["status"] for r in results]
    assert statuses[:3] == [202, 200, 422]
    assert sorted(statuses[3:5]) == [200, 202]  # the same event twice in one batch: accepted once
    assert statuses[5:] == [422, 202]
    assert results[1]["event"]["duplicate"] is True
    assert results[1]["event"]["accepted_at"] == earlier.json()["accepted_at"]
    assert results[2]["error"] == "invalid_fields"
    assert [d["field"] for d in results[2]["details"]] == ["type"]
    assert "reserved" in results[5]["message"]
    published = {r["event"]["id"] for r in results if r["status"] == 202}
    assert len(published) == 3

    # 500 at once, in one confirm round; one more is refused whole.
    many = [{"tenant": acme, "type": "order.bulk", "data": {"n": n}} for n in range(500)]
    async with client(system.ingest.base_url) as api:
        bulk = await api.post("/v1/events/batch", json={"events": many})
        too_many = await api.post("/v1/events/batch", json={"events": [*many, many[0]]})
    assert bulk.status_code == 200, bulk.text
    assert [r["status"] for r in bulk.json()["results"]] == [202] * 500
    assert too_many.status_code == 422, too_many.text
    published |= {r["event"]["id"] for r in bulk.json()["results"]}
    # Every one first: order is promised to ordered endpoints only (two dispatchers take the lane, and a
    # burst of 500 may isolate the endpoint, its copies handed on or put off), so a sentinel published
    # later can come before an earlier event (a newcomer's make test failed so). It then closes the
    # "nothing twice" check.
    await receiver.wait_for_ids(published | {f"evt_earlier_{acme}"}, path="/batch", timeout_s=120)
    await sentinel_arrives(system, receiver, acme, "/batch")
    got = deliveries(receiver, "/batch")
    assert {event_id for event_id in got if "sentinel" not in event_id} == published | {f"evt_earlier_{acme}"}
    twice = sorted(event_id for event_id, count in got.items() if count > 1)
    # At least once: a dispatcher whose connection the broker dropped gets its unacked lane messages
    # again (CI saw both replicas closed with 541 INTERNAL_ERROR while they declared the same queue of
    # its own); without that, a second delivery can only be a second publish.
    assert not twice or logged(system.dispatchers, "broker_connection_lost"), f"sent twice: {twice}"


async def test_without_a_trace_exporter_the_publishers_trace_context_reaches_the_receiver_unchanged(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    system.add_endpoint(acme, receiver.url("/trace"), ["order.*"])
    sent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with client(system.ingest.base_url) as api:
        answer = await api.post(
            "/v1/events", json={"id": f"evt_trace_{acme}", "tenant": acme, "type": "order.created", "data": {}},
            headers={"traceparent": sent},
        )  # fmt: skip
        malformed = await api.post(
            "/v1/events", json={"id": f"evt_badtrace_{acme}", "tenant": acme, "type": "order.created", "data": {}},
            headers={"traceparent": "00-not-a-trace-01"},
        )  # fmt: skip
    assert answer.status_code == 202, answer.text
    assert malformed.status_code == 202, malformed.text  # a malformed one is dropped, as W3C says
    await eventually(lambda: asyncio.sleep(0, len(deliveries(receiver, "/trace")) == 2))
    headers = {json.loads(r.body)["id"]: r.headers for r in receiver.requests if r.path == "/trace"}
    assert headers[f"evt_trace_{acme}"]["traceparent"] == sent
    assert "traceparent" not in headers[f"evt_badtrace_{acme}"]


@asynccontextmanager
async def serving(app: FastAPI, sock: socket.socket) -> AsyncIterator[None]:
    """uvicorn on an already bound socket (its port was registered before the app, which needs the
    endpoint's secret, existed)."""
    config = uvicorn.Config(
        app, lifespan="off", ws="none", log_level="warning", access_log=False, timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await eventually(lambda: asyncio.sleep(0, server.started or task.done()), timeout_s=10)
    assert not task.done(), task.exception()
    try:
        yield
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=30)


def api(system: System) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=30
    )


async def publish(system: System, event: dict[str, Any]) -> None:
    async with api(system) as client:
        answer = await client.post("/v1/events", json=event)
    assert answer.status_code == 202, answer.text


async def test_the_receiver_library_handles_each_real_delivery_once(system: System, tmp_path: Path) -> None:
    acme = tenant()
    calls: Counter[str] = Counter()  # the handler's runs, failed ones included
    handled: Counter[str] = Counter()  # its runs that returned
    arrivals: Counter[str] = Counter()  # verified requests, duplicates included
    captured: dict[str, tuple[dict[str, str], bytes]] = {}

    async def handler(delivery: Delivery) -> None:
        calls[delivery.webhook_id] += 1
        if delivery.json()["data"].get("fail_first") and calls[delivery.webhook_id] == 1:
            raise RuntimeError("the handler's database blinked")
        handled[delivery.webhook_id] += 1

    def seen(headers: dict[str, str], body: bytes) -> None:
        arrivals[headers["webhook-id"]] += 1
        captured.setdefault(headers["webhook-id"], (headers, body))

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    endpoint = system.add_endpoint(acme, f"{base_url}/hooks", ["order.*"])
    secret = endpoint["secret"]
    store = SQLiteStore(tmp_path / "seen.db")
    app = fastapi_app(secret, store, handler, seen=seen)

    ids = [f"evt_{n}_{acme}" for n in ("a", "b", "c")]
    flaky = f"evt_flaky_{acme}"
    sentinel = f"evt_sentinel_{acme}"
    async with serving(app, sock), httpx.AsyncClient(base_url=base_url, timeout=30) as receiver:
        for event_id in ids:
            await publish(system, {"id": event_id, "tenant": acme, "type": "order.created", "data": {}})
        await publish(
            system, {"id": flaky, "tenant": acme, "type": "order.created", "data": {"fail_first": True}}
        )
        await eventually(
            lambda: asyncio.sleep(0, all(handled[i] for i in [*ids, flaky])),
            timeout_s=30,
            explain=lambda: f"handled {dict(handled)}, calls {dict(calls)}\n{system.logs()[-4000:]}",
        )
        # The failed run left the id open: hookline's retry (answered 500 the first time) ran it again.
        assert calls[flaky] == 2

        # Replayed byte for byte (a captured request; or an attacker's copy within the tolerance).
        headers, body = captured[ids[0]]
        replay = {k: v for k, v in headers.items() if k.startswith("webhook-") or k == "content-type"}
        again = await receiver.post("/hooks", content=body, headers=replay)
        assert (again.status_code, again.json()) == (200, {"status": "duplicate"})

        # hookline's resend: the same webhook-id, signed anew; the receiver says 2xx and runs nothing.
        async with api(system) as client:
            await eventually(
                lambda: _logged(client, ids[1]), explain=lambda: f"{ids[1]} not in the delivery log"
            )
            resent = await client.post(f"/v1/events/{ids[1]}/resend", json={"endpoint_id": endpoint["id"]})
        assert resent.status_code == 202, resent.text
        assert resent.json()["status"] == 200
        assert arrivals[ids[1]] == 2

        # Forged (another secret) and tampered (a genuine signature over another body): refused.
        forged_id = f"evt_forged_{acme}"
        forged_body = b'{"id":"%s","type":"order.created","data":{}}' % forged_id.encode()
        forged = signing.webhook_headers(
            [signing.secret_key(signing.generate_secret())],
            forged_id,
            forged_body,
            timestamp_s=int(headers["webhook-timestamp"]),
        )
        answer = await receiver.post("/hooks", content=forged_body, headers=forged)
        assert (answer.status_code, answer.json()) == (401, {"detail": "no_matching_signature"})
        tampered = body.replace(b"order.created", b"order.refunded")
        answer = await receiver.post("/hooks", content=tampered, headers={**replay, "webhook-id": ids[2]})
        assert answer.status_code == 401

        # Nothing else ran: the sentinel, published last, is handled, and every other count is one.
        await publish(system, {"id": sentinel, "tenant": acme, "type": "order.sentinel", "data": {}})
        await eventually(lambda: asyncio.sleep(0, handled[sentinel] == 1), timeout_s=30)
    sock.close()
    store.close()
    assert handled == Counter({i: 1 for i in [*ids, flaky, sentinel]})
    assert forged_id not in calls
    assert calls == Counter({i: 1 for i in [*ids, sentinel]}) + Counter({flaky: 2})


async def test_during_a_rotation_a_receiver_holding_only_the_new_secret_verifies(
    system: System, tmp_path: Path
) -> None:
    acme = tenant()
    handled: Counter[str] = Counter()
    signatures: list[int] = []

    async def handler(delivery: Delivery) -> None:
        handled[delivery.webhook_id] += 1

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    endpoint = system.add_endpoint(acme, f"http://127.0.0.1:{sock.getsockname()[1]}/hooks", ["order.*"])
    async with api(system) as client:
        rotated = await client.post(f"/v1/endpoints/{endpoint['id']}/rotate-secret", json={})
    assert rotated.status_code == 200, rotated.text
    store = SQLiteStore(tmp_path / "seen.db")
    app = fastapi_app(
        rotated.json()["secret"],
        store,
        handler,
        seen=lambda headers, _: signatures.append(len(headers["webhook-signature"].split())),
    )
    event_id = f"evt_rotated_{acme}"
    async with serving(app, sock):
        await publish(system, {"id": event_id, "tenant": acme, "type": "order.created", "data": {}})
        await eventually(lambda: asyncio.sleep(0, handled[event_id] == 1), timeout_s=30)
    sock.close()
    store.close()
    assert signatures == [2]  # hookline signs with the new secret and the old one during the overlap


async def _logged(client: httpx.AsyncClient, event_id: str) -> bool:
    return (await client.get(f"/v1/events/{event_id}")).status_code == 200


async def test_large_bodies_arrive_gzipped_numbered_and_verify_once_inflated(
    system: System, tmp_path: Path
) -> None:
    """An endpoint with gzip_over_bytes: a body over it goes compressed (content-encoding: gzip), one under
    it plain; the library inflates before it verifies, so the handler gets the event as published. The
    event's sequence comes as webhook-sequence, on a resend too."""
    acme = tenant()
    handled: dict[str, Any] = {}
    arrived: dict[str, dict[str, str]] = {}

    async def handler(delivery: Delivery) -> None:
        handled[delivery.webhook_id] = delivery.json()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    endpoint = system.add_endpoint(acme, f"{base_url}/hooks", ["order.*"], gzip_over_bytes=1024)

    def seen(headers: dict[str, str], _: bytes) -> None:
        arrived.setdefault(headers["webhook-id"], headers)

    app = fastapi_app(endpoint["secret"], SQLiteStore(tmp_path / "seen.db"), handler, seen=seen)
    large, small = f"evt_large_{acme}", f"evt_small_{acme}"
    note = "x" * 20_000
    async with serving(app, sock):
        await publish(system, {
            "id": large, "tenant": acme, "type": "order.created", "subject": "order_9", "sequence": 7,
            "data": {"note": note},
        })  # fmt: skip
        await publish(
            system, {"id": small, "tenant": acme, "type": "order.created", "data": {"note": "short"}}
        )
        await eventually(
            lambda: asyncio.sleep(0, large in handled and small in handled),
            timeout_s=30,
            explain=lambda: f"handled {sorted(handled)}\n{system.logs()[-3000:]}",
        )
        assert handled[large]["data"]["note"] == note
        assert handled[large]["sequence"] == 7
        assert arrived[large]["content-encoding"] == "gzip"
        assert int(arrived[large]["content-length"]) < len(note) // 10
        assert arrived[large]["webhook-sequence"] == "7"
        assert "content-encoding" not in arrived[small]
        assert "webhook-sequence" not in arrived[small]
        # The ingest's resend goes the same way (one definition of the request: shared/contracts/webhook.py).
        async with api(system) as client:
            await eventually(
                lambda: _logged(client, large), explain=lambda: f"{large} not in the delivery log"
            )
            arrived.pop(large)
            resent = await client.post(f"/v1/events/{large}/resend", json={"endpoint_id": endpoint["id"]})
        assert resent.status_code == 202, resent.text
        assert (arrived[large]["content-encoding"], arrived[large]["webhook-sequence"]) == ("gzip", "7")
    sock.close()
