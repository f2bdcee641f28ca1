"""hookline.receiver as a customer runs it: a FastAPI app on 127.0.0.1 (uvicorn, in this process) is the
endpoint of real deliveries from the running system. Each event's handler runs once, including one whose
handler failed once (answered 500, retried by hookline); a captured delivery replayed byte for byte and
hookline's own resend (same webhook-id, new signature) are answered 2xx without running the handler; a
forged or tampered request is refused 401 and runs nothing."""

from __future__ import annotations

import asyncio
import socket
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
from support.receiver_apps import fastapi_app
from support.system import System, tenant
from support.waiting import eventually

from hookline.receiver import Delivery, SQLiteStore
from hookline.shared.outbound import signing

pytestmark = pytest.mark.e2e


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
