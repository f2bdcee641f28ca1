"""Endpoint operations while events flow: queue moves, deletes with deliveries in flight, the 409 that
counts deliveries in progress, and retry bookkeeping a receiver or an upstream cannot derail."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aio_pika
import httpx
import pytest
from aiohttp import web
from support import deliverylog, services
from support.amqp import event, publish_event, queue_exists
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

SYSTEM_ENV = {
    # Queues an endpoint left are removed 3 s after they were last seen empty, polled twice a second.
    "HOOKLINE_RETIRED_QUEUE_GRACE_S": "3",
    "HOOKLINE_QUEUE_POLL_S": "0.5",
    # Every retry after 1 s exactly (base_env turns jitter off).
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    # Breakers stay out of the way: failures here are scripted, never a reason to stop delivering.
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "100000",
    "HOOKLINE_BREAKER_SLOW_THRESHOLD": "100000",
    # A few deliveries per dispatcher at a time, so a slow receiver leaves events queued behind them.
    "HOOKLINE_PREFETCH_PER_ENDPOINT": "4",
}


# --- helpers -----------------------------------------------------------------------------------------


@asynccontextmanager
async def api(system: System) -> AsyncIterator[httpx.AsyncClient]:
    """The ingest API without blocking the event loop the receiver answers on."""
    async with httpx.AsyncClient(
        base_url=system.ingest.base_url,
        headers={"authorization": f"Bearer {services.TOKEN}"},
        timeout=30,
    ) as client:
        yield client


class Upstream:
    """An upstream publisher on one connection: persistent, confirmed, like ``publish_event``."""

    def __init__(self, amqp_url: str) -> None:
        self._url = amqp_url
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._exchange: aio_pika.abc.AbstractExchange | None = None

    async def __aenter__(self) -> Upstream:
        self._connection = await aio_pika.connect(self._url)
        channel = await self._connection.channel(publisher_confirms=True)
        self._exchange = await channel.get_exchange("events", ensure=False)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._connection is not None
        await self._connection.close()

    async def publish(self, body: dict[str, Any]) -> None:
        assert self._exchange is not None
        message = aio_pika.Message(
            json.dumps(body).encode(),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=str(body["id"]),
        )
        await self._exchange.publish(message, routing_key=f"{body['tenant']}.{body['type']}")


def endpoint_queue(endpoint_id: str, generation: int) -> str:
    base = f"hookline.endpoint.{endpoint_id}"
    return base if generation == 0 else f"{base}.g{generation}"


async def dead_letters(system: System, endpoint_id: str) -> list[dict[str, Any]]:
    """Every dead letter the ingest lists for the endpoint, page after page."""
    items: list[dict[str, Any]] = []
    after: str | None = None
    async with api(system) as client:
        while True:
            params: dict[str, str | int] = {"endpoint_id": endpoint_id, "limit": 50}
            if after is not None:
                params["after"] = after
            response = await client.get("/v1/dead-letters", params=params)
            assert response.status_code == 200, response.text
            page = response.json()
            items += page["data"]
            after = page["next_after"]
            if after is None:
                return items


def webhook_ids(receiver: Receiver, path: str) -> Counter[str]:
    return Counter(r.headers["webhook-id"] for r in receiver.requests if r.path == path)


def attempts_of(receiver: Receiver, event_id: str) -> list[Received]:
    return [r for r in receiver.requests if r.headers.get("webhook-id") == event_id]


class OwnReceiver(Receiver):
    """A receiver that accounts only for the requests to its own path (a port of this machine may still
    be named by another test's endpoint, whose retries could land here): how many were open at once,
    and which events it answered 2xx on a connection still open, i.e. the sender got that answer (not
    one whose sender was killed meanwhile)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.open = 0
        self.most_open = 0
        self.answered: set[str] = set()

    def own_url(self) -> str:
        return self.url(self.path)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path != self.path:
            return await super()._handle(request)
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            response = await super()._handle(request)
        finally:
            self.open -= 1
        transport = request.transport
        if response.status < 300 and transport is not None and not transport.is_closing():
            self.answered.add(request.headers.get("webhook-id", ""))
        return response


class Heartbeats:
    """The dispatchers' heartbeats as they are published (a queue of the test's own on the telemetry
    exchange): what the ingest's delete check reads."""

    def __init__(self, amqp_url: str) -> None:
        self._url = amqp_url
        self.latest: dict[str, dict[str, Any]] = {}  # dispatcher id -> its last heartbeat
        self._connection: aio_pika.abc.AbstractConnection | None = None

    async def __aenter__(self) -> Heartbeats:
        self._connection = await aio_pika.connect(self._url)
        channel = await self._connection.channel()
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind("hookline.telemetry")
        await queue.consume(self._on_message, no_ack=True)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._connection is not None
        await self._connection.close()

    async def _on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        for record in json.loads(message.body):
            if record.get("kind") == "heartbeat":
                self.latest[record["dispatcher_id"]] = record

    def held(self, endpoint_id: str) -> int:
        """Messages of the endpoint the dispatchers said they hold, in their latest heartbeats."""
        return sum(beat.get("unacked", {}).get(endpoint_id, 0) for beat in self.latest.values())


async def sentinel_through_a_retry(
    system: System, receiver: Receiver, acme: str, event_type: str, failing: set[str]
) -> str:
    """Publish an event the receiver fails once and accepts on its retry, and wait for that success.

    Its retry goes through the same 1 s delay as any retry still due for the endpoint, so once it has
    arrived, an attempt scheduled before it would have arrived too."""
    sentinel = f"evt_sentinel_{acme}"
    failing.add(sentinel)
    await publish_event(system.amqp_url, event(acme, event_type, sentinel), f"{acme}.{event_type}")

    async def succeeded() -> bool:
        return len(attempts_of(receiver, sentinel)) >= 2

    await eventually(succeeded, timeout_s=20)
    return sentinel


# --- tests --------------------------------------------------------------------------------------------


async def test_force_delete_after_removing_a_rate_limit(system: System, receiver: Receiver) -> None:
    """Reproduced bug: removing ``rate_limit_per_s`` (a queue move) then ``DELETE ?force=true`` answered
    500 (PRECONDITION_FAILED, inequivalent arg 'x-single-active-consumer'); it deletes the endpoint."""
    acme = tenant()
    endpoint = system.add_endpoint(acme, receiver.url(f"/limited-{acme}"), ["#"], rate_limit_per_s=5)
    async with api(system) as client:
        patched = await client.patch(f"/v1/endpoints/{endpoint['id']}", json={"rate_limit_per_s": None})
        assert patched.status_code == 200, patched.text
        assert patched.json()["rate_limit_per_s"] is None

        deleted = await client.delete(f"/v1/endpoints/{endpoint['id']}", params={"force": "true"})
        assert deleted.status_code == 204, deleted.text
        assert (await client.get(f"/v1/endpoints/{endpoint['id']}")).status_code == 404


async def test_options_that_move_the_queue_change_under_a_stream_of_events(
    system: System, receiver: Receiver
) -> None:
    """Adding and removing ``rate_limit_per_s``, ``max_in_flight`` and ``ordered`` while events keep
    arriving: each addition gives the endpoint a queue of its own (of the next generation: a single
    active consumer), each removal takes it back to its lane, and every event is delivered exactly once
    (no failure here, so at-least-once allows no duplicate), but for those published from the moment
    ``ordered`` was added until it was removed: an event then may come both ways, straight to its queue
    and through its lane (README, Ordering and PATCH); the queues left behind are removed once drained and
    the grace has passed."""
    acme = tenant()
    path = f"/moving-{acme}"
    endpoint = system.add_endpoint(acme, receiver.url(path), ["#"])
    endpoint_id = endpoint["id"]
    ids = [f"evt_moving_{n:03d}" for n in range(150)]
    changes: list[dict[str, Any]] = [
        {"rate_limit_per_s": 200},
        {"rate_limit_per_s": None},
        {"max_in_flight": 3},
        {"max_in_flight": None},
        {"ordered": True},
        {"ordered": False},
    ]

    receiver.responder = lambda _: Reply(delay_s=0.05)  # deliveries take a moment: some are in flight
    # The stream and the changes keep pace with each other: change k is made once 20·k events are
    # out, and the stream goes on while it is made, never more than 15 events past its turn; so every
    # change lands in the middle of the stream, and 30 events follow the last one.
    published = 0
    started = 0
    progress = asyncio.Condition()
    ordered_from = ordered_to = 0  # published from the request that adds ordered to the answer removing it

    async def publish_steadily() -> None:
        nonlocal published
        async with Upstream(system.amqp_url) as upstream:
            for n, event_id in enumerate(ids):
                due = min(len(changes), max(0, (n - 15) // 20))
                async with progress:
                    await progress.wait_for(lambda due=due: started >= due)
                # Subjects, so that the ordered stretch has subjects to keep in order.
                await upstream.publish({**event(acme, "order.paid", event_id, n=n), "subject": f"s{n % 5}"})
                async with progress:
                    published += 1
                    progress.notify_all()
                await asyncio.sleep(0.04)  # pacing the stream (~6 s), not waiting for anything

    async def change_steadily() -> None:
        nonlocal started, ordered_from, ordered_to
        async with api(system) as client:
            for step, change in enumerate(changes, start=1):
                async with progress:
                    await progress.wait_for(lambda step=step: published >= step * 20)
                    started += 1
                    progress.notify_all()
                if change == {"ordered": True}:
                    ordered_from = published
                response = await client.patch(f"/v1/endpoints/{endpoint_id}", json=change)
                assert response.status_code == 200, response.text
                if change == {"ordered": False}:
                    ordered_to = published + 1  # and the one being published as it answered

    async with asyncio.timeout(60), asyncio.TaskGroup() as group:
        group.create_task(publish_steadily())
        group.create_task(change_steadily())
    assert (published, started) == (len(ids), len(changes))

    async def all_delivered() -> bool:
        return webhook_ids(receiver, path).keys() >= set(ids)

    await eventually(all_delivered, timeout_s=30)
    # Nothing else comes after them: a sentinel published now arrives, and with it no second copy.
    sentinel = "evt_moving_sentinel"
    await publish_event(system.amqp_url, event(acme, "order.paid", sentinel), f"{acme}.order.paid")

    async def sentinel_arrived() -> bool:
        return sentinel in webhook_ids(receiver, path)

    await eventually(sentinel_arrived, timeout_s=20)
    seen = webhook_ids(receiver, path)
    # While it was ordered its lane copies were handed on as second copies, each skipped by the replica
    # that took its straight twin from the queue. Here ordered is removed a second later, before they
    # come: the queue is gone, and a second copy forwarded to the lane by the other replica is sent
    # again; going back, an event published between the lane's binding and the queue's unbinding comes
    # both ways (docs/decisions.md, "Going back"). At least once there.
    switching = set(ids[ordered_from:ordered_to])
    duplicates = {event_id: n for event_id, n in seen.items() if n > 1 and event_id not in switching}
    assert not duplicates, f"delivered more than once: {duplicates}"
    assert set(seen) == {*ids, sentinel}

    # Back in its lane now (no option needs a queue of its own): the generations it spent there never had
    # a queue, and the three it had (1, 3, 5: a rate limit, max_in_flight, ordered, each with a single
    # active consumer) are removed once drained.
    async def queues_removed() -> bool:
        for generation in range(len(changes) + 1):
            if await queue_exists(system.amqp_url, endpoint_queue(endpoint_id, generation)):
                return False
        return True

    await eventually(queues_removed, timeout_s=30, every_s=0.5)


async def test_max_in_flight_added_later_applies_after_the_move(system: System) -> None:
    """``max_in_flight: 2`` added to an endpoint created without it: from then on the receiver never
    has more than 2 requests open at once, with two dispatchers running (before, it had more)."""
    assert all(d.process.poll() is None for d in system.dispatchers), "two dispatchers must run"
    acme = tenant()
    async with OwnReceiver(f"/capped-{acme}") as receiver:
        # Held until three are open at once (then 1 s more): without a cap they are, however slowly the
        # dispatchers send them.
        receiver.responder = lambda _: Reply(delay_s=1.0, hold_until_open=3)
        endpoint = system.add_endpoint(acme, receiver.own_url(), ["#"])
        before = [f"evt_uncapped_{acme}_{n}" for n in range(8)]
        async with Upstream(system.amqp_url) as upstream:
            for event_id in before:
                await upstream.publish(event(acme, "a.b", event_id))
        await receiver.wait_for(len(before), path=receiver.path, timeout_s=20)

        async def idle() -> bool:
            return receiver.open == 0

        await eventually(idle, timeout_s=20)
        assert receiver.most_open > 2, "without a cap, more than 2 requests should have been open"

        async with api(system) as client:
            response = await client.patch(f"/v1/endpoints/{endpoint['id']}", json={"max_in_flight": 2})
            assert response.status_code == 200, response.text
        receiver.most_open = 0
        receiver.responder = lambda _: Reply(delay_s=0.5)
        after = [f"evt_capped_{acme}_{n}" for n in range(10)]
        async with Upstream(system.amqp_url) as upstream:
            for event_id in after:
                await upstream.publish(event(acme, "a.b", event_id))

        async def all_delivered() -> bool:
            return webhook_ids(receiver, receiver.path).keys() >= set(after)

        await eventually(all_delivered, timeout_s=30)
        await eventually(idle, timeout_s=10)
        assert 1 <= receiver.most_open <= 2, f"{receiver.most_open} requests were open at once"


async def test_delete_waits_for_deliveries_in_flight(system: System, receiver: Receiver) -> None:
    """A DELETE without force answers 409 ``events_pending`` while deliveries are in progress, even
    with nothing ready in the queue (dispatchers report what they hold in their heartbeats); once
    everything is delivered it answers 204."""
    acme = tenant()
    receiver.responder = lambda _: Reply(delay_s=6.0)  # longer than a heartbeat interval (5 s)
    path = f"/slow-{acme}"
    endpoint = system.add_endpoint(acme, receiver.url(path), ["#"])
    ids = [f"evt_slow_{n}" for n in range(3)]
    async with Heartbeats(system.amqp_url) as heartbeats, api(system) as client:
        async with Upstream(system.amqp_url) as upstream:
            for event_id in ids:
                await upstream.publish(event(acme, "a.b", event_id))
        # All three are being delivered (prefetch 4 per dispatcher): none is left ready in the queue.
        await receiver.wait_for(len(ids), path=path, timeout_s=20)

        async def reported() -> bool:
            return heartbeats.held(endpoint["id"]) > 0

        await eventually(reported, timeout_s=15)
        refused = await client.delete(f"/v1/endpoints/{endpoint['id']}")
        assert refused.status_code == 409, refused.text
        body = refused.json()
        assert body["error"] == "events_pending"
        counts = re.search(r"(\d+) events are queued and (\d+) being delivered", body["message"])
        assert counts is not None, body["message"]
        assert int(counts[1]) == 0, body["message"]  # nothing ready in the queue ...
        assert int(counts[2]) >= 1, body["message"]  # ... but deliveries in progress

        # Once the deliveries are done (and a heartbeat says so), the same DELETE goes through.
        async def deleted() -> bool:
            response = await client.delete(f"/v1/endpoints/{endpoint['id']}")
            assert response.status_code in (204, 409), response.text
            return response.status_code == 204

        await eventually(deleted, timeout_s=30, every_s=0.5)
    assert set(webhook_ids(receiver, path)) == set(ids)
    assert await dead_letters(system, endpoint["id"]) == []


async def test_a_unicode_digit_in_retry_after_is_retried_on_schedule(
    system: System, receiver: Receiver
) -> None:
    """Reproduced bug: ``503`` with ``Retry-After: ²`` crashed the handler (``"²".isdigit()`` is true,
    ``float("²")`` fails), so the event looped instead of being retried. Now it follows the schedule
    (1 s here) and ends as a ``max_attempts`` dead letter after 3 attempts."""
    acme = tenant()
    failing: set[str] = set()

    def respond(request: Received) -> Reply:
        event_id = request.headers["webhook-id"]
        if event_id in failing and attempts_of(receiver, event_id):  # its retry succeeds
            return Reply(204)
        return Reply(503, headers={"Retry-After": "\u00b2"})

    receiver.responder = respond
    endpoint = system.add_endpoint(acme, receiver.url(f"/superscript-{acme}"), ["#"], max_attempts=3)
    event_id = f"evt_superscript_{acme}"
    await publish_event(system.amqp_url, event(acme, "a.b", event_id), f"{acme}.a.b")

    async def dead() -> list[dict[str, Any]] | None:
        items = await dead_letters(system, endpoint["id"])
        return items or None

    items = await eventually(dead, timeout_s=30, every_s=0.5)
    assert [(i["event_id"], i["reason"], i["attempts"], i["last_status"]) for i in items] == [
        (event_id, "max_attempts", 3, 503)
    ]
    await sentinel_through_a_retry(system, receiver, acme, "a.b", failing)
    assert len(attempts_of(receiver, event_id)) == 3
    # Retried on the schedule, as hookline decided and did (the Retry-After it could not read ignored).
    logged = await deliverylog.attempts_of(system, event_id, endpoint["id"], at_least=3)
    assert [a["status"] for a in logged] == [503, 503, 503]
    deliverylog.assert_retried_after(logged, [1, 1])
    crashes = [
        line for line in system.logs().splitlines() if "handler_crashed" in line and endpoint["id"] in line
    ]
    assert not crashes, crashes


async def test_upstream_attempt_headers_do_not_shorten_retries(system: System, receiver: Receiver) -> None:
    """Reproduced bug: an upstream publishing with ``x-hookline-attempt: 999`` had its event attempted
    once and dead-lettered with ``attempts: 999``. Hookline's headers on a message from ``events`` are
    not hookline's: the event gets its 3 attempts."""
    acme = tenant()
    failing: set[str] = set()

    def respond(request: Received) -> Reply:
        event_id = request.headers["webhook-id"]
        if event_id in failing and attempts_of(receiver, event_id):  # its retry succeeds
            return Reply(204)
        return Reply(500)

    receiver.responder = respond
    endpoint = system.add_endpoint(acme, receiver.url(f"/forged-{acme}"), ["#"], max_attempts=3)
    event_id = f"evt_forged_headers_{acme}"
    await publish_event(
        system.amqp_url,
        event(acme, "a.b", event_id),
        f"{acme}.a.b",
        headers={"x-hookline-attempt": 999, "x-hookline-first-attempt-at": 1, "x-hookline-seq": 5},
    )

    async def dead() -> list[dict[str, Any]] | None:
        items = await dead_letters(system, endpoint["id"])
        return items or None

    items = await eventually(dead, timeout_s=30, every_s=0.5)
    assert [(i["event_id"], i["reason"], i["attempts"]) for i in items] == [(event_id, "max_attempts", 3)]
    await sentinel_through_a_retry(system, receiver, acme, "a.b", failing)
    assert len(attempts_of(receiver, event_id)) == 3


async def test_force_delete_with_deliveries_in_flight_and_a_dispatcher_killed(own_system: System) -> None:
    """DELETE without loss: force-deleting an endpoint while events are queued and some are being
    delivered, then SIGKILLing a dispatcher in the middle of its deliveries, loses none: every event
    was delivered (answered 2xx to a dispatcher still there) or is listed as an ``endpoint_gone`` dead
    letter. (Last in the module: it kills a dispatcher.)"""
    system = own_system  # it kills a service: a system of its own
    acme = tenant()
    async with OwnReceiver(f"/deleted-{acme}") as receiver:
        receiver.responder = lambda _: Reply(delay_s=4.0)
        endpoint = system.add_endpoint(acme, receiver.own_url(), ["#"])
        ids = [f"evt_deleted_{acme}_{n:02d}" for n in range(24)]
        async with Upstream(system.amqp_url) as upstream:
            for event_id in ids:
                await upstream.publish(event(acme, "a.b", event_id))
        # Both dispatchers are delivering (4 each at most), the rest wait in the queue.
        await receiver.wait_for(8, path=receiver.path, timeout_s=20)
        async with api(system) as client:
            response = await client.delete(f"/v1/endpoints/{endpoint['id']}", params={"force": "true"})
            assert response.status_code == 204, response.text
        system.dispatchers[0].kill()

        async def accounted() -> list[dict[str, Any]] | None:
            gone = await dead_letters(system, endpoint["id"])
            return gone if receiver.answered | {g["event_id"] for g in gone} >= set(ids) else None

        gone = await eventually(accounted, timeout_s=45, every_s=0.5)
        received = set(webhook_ids(receiver, receiver.path))
    assert {g["reason"] for g in gone} == {"endpoint_gone"}
    # The fault hit what the test meant it to: events still queued at the delete, and deliveries the
    # killed dispatcher had started and never saw answered; both are among the dead letters.
    assert set(ids) - received, "every event had reached the receiver before the delete"
    killed_mid_delivery = received - receiver.answered
    assert killed_mid_delivery, "the killed dispatcher was delivering nothing"
    assert killed_mid_delivery <= {g["event_id"] for g in gone}
