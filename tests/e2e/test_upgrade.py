"""An endpoint registered by a version before lanes keeps working after an upgrade.

Its queue was bound to ``events`` directly (two versions back; the version before added route exchanges
in between) and its retries were addressed to the queue. The ingest moves it onto its tenant's lane at
start (once, conditionally): the lane bound first, then its record, then its old bindings removed; its
old queue is drained into its lane. Nothing queued before is lost, and its retries still come back.
(An event published in the moment between its record and the removal of its old bindings reaches it
twice: at least once; the test publishes after the move.)
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import pytest
from support import broker as test_broker
from support import services
from support.amqp import event, publish_event
from support.receiver import Received, Receiver, Reply
from support.waiting import eventually

from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker
from hookline.shared.contracts.models import EndpointUpserted, SigningSecret, StoredEndpoint
from hookline.shared.outbound.signing import generate_secret

pytestmark = pytest.mark.e2e


async def _register_the_old_way(amqp_url: str, endpoint: StoredEndpoint) -> None:
    """What the previous version's ingest did: a queue bound to ``events`` and to the delay exchange by
    its own name, and an unconditional record without the new fields."""
    async with Broker(amqp_url, name="old-ingest", connect_timeout_s=10) as broker:
        await topology.declare(broker, topology.Retention())
        async with broker.channel(confirms=True) as channel:
            queue = await channel.declare_queue(
                topology.endpoint_queue(endpoint.id),
                durable=True,
                arguments=topology.endpoint_queue_arguments(single_consumer=False),
            )
            for key in topology.binding_keys(endpoint.tenant, endpoint.event_types):
                await queue.bind(topology.EVENTS_EXCHANGE, routing_key=key)
            await queue.bind(topology.DELAY_DELIVERY, routing_key=topology.delay_delivery_binding(queue.name))
            record = EndpointUpserted(
                change_id=f"chg_{uuid.uuid4().hex}", at=endpoint.created_at, endpoint=endpoint
            )
            body = record.model_dump_json(
                exclude={
                    "base_version": True,
                    "endpoint": {"queue_generation", "retired_queues", "routed", "laned", "version"},
                }
            )
            await channel.default_exchange.publish(
                aio_pika.Message(body.encode(), content_type="application/json", message_id=record.change_id),
                routing_key=topology.ENDPOINT_LOG,
            )


async def _arrived(receiver: Receiver, event_id: str) -> bool:
    return any(r.headers.get("webhook-id") == event_id for r in receiver.requests)


@pytest.fixture
async def legacy(rabbitmq: test_broker.Broker, tmp_path: Path) -> AsyncIterator[tuple[str, dict[str, str]]]:
    with rabbitmq.vhost("upgrade") as amqp_url:
        env = services.base_env(amqp_url, HOOKLINE_STATE_DIR=str(tmp_path / "state"))
        yield amqp_url, env


async def test_an_endpoint_of_the_previous_version_is_upgraded_without_loss(
    legacy: tuple[str, dict[str, str]], receiver: Receiver, tmp_path: Path
) -> None:
    amqp_url, env = legacy
    tenant = f"t{uuid.uuid4().hex[:10]}"
    now = datetime.now(UTC)
    endpoint = StoredEndpoint(
        id=f"ep_01OLD{uuid.uuid4().hex[:21].upper()}",
        tenant=tenant,
        url=receiver.url("/old"),
        event_types=["#"],
        created_at=now,
        updated_at=now,
        secrets=[SigningSecret(value=generate_secret(), created_at=now)],
    )
    await _register_the_old_way(amqp_url, endpoint)
    seen: set[str] = set()

    def respond(request: Received) -> Reply:
        event_id = request.headers["webhook-id"]
        if event_id == "evt_old_retried" and event_id not in seen:
            seen.add(event_id)
            return Reply(status=500)  # its retry must find its way back after the upgrade
        return Reply(status=204)

    receiver.responder = respond
    before = [f"evt_old_before_{n}" for n in range(5)]
    for event_id in before:  # queued while nothing runs
        await publish_event(amqp_url, event(tenant, "a.b", event_id), f"{tenant}.a.b")

    running = [services.start(name, env, tmp_path) for name in ("ingest", "dispatcher")]
    try:
        for service in running:
            service.wait_ready()
        ingest = running[0]

        queue = topology.endpoint_queue(endpoint.id)
        lane = topology.lane_of(tenant)

        async def upgraded() -> dict[str, Any] | None:
            async with httpx.AsyncClient(
                base_url=ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}
            ) as api:
                shown = (await api.get(f"/v1/endpoints/{endpoint.id}")).json()
            if shown.get("version", 0) < 2:
                return None
            pairs = await bindings(amqp_url)
            return shown if ("events", queue) not in pairs and ("events", lane) in pairs else None

        await eventually(upgraded, timeout_s=30)
        after = ["evt_old_retried", *(f"evt_old_after_{n}" for n in range(5))]
        for event_id in after:
            await publish_event(amqp_url, event(tenant, "a.b", event_id), f"{tenant}.a.b")
        await receiver.wait_for(len(before) + len(after) + 1, path="/old", timeout_s=30)
        # A sentinel published last: once it is in, a duplicate of anything before would be too.
        await publish_event(amqp_url, event(tenant, "a.b", "evt_old_sentinel"), f"{tenant}.a.b")
        await eventually(lambda: _arrived(receiver, "evt_old_sentinel"), timeout_s=30)
        delivered = Counter(r.headers["webhook-id"] for r in receiver.requests if r.path == "/old")
        # Every event once (the retried one twice: its failed attempt and its retry), none lost.
        assert delivered == {**dict.fromkeys([*before, *after, "evt_old_sentinel"], 1), "evt_old_retried": 2}
        # Its lane feeds it now: no binding of its own is left, and no route exchange was made for it.
        pairs = await bindings(amqp_url)
        left = [
            pair
            for pair in pairs
            if (queue in pair and pair[0] != "") or topology.route_exchange(endpoint.id) in pair[0]
        ]
        assert not left, "only the default exchange's implicit binding to its old queue is left"
        assert ("events", lane) in pairs
    finally:
        codes = [service.stop() for service in running]
    assert codes == [0, 0]


async def bindings(amqp_url: str) -> set[tuple[str, ...]]:
    listed = await asyncio.to_thread(
        subprocess.run,
        ["rabbitmqctl", "-q", "list_bindings", "-p", amqp_url.rsplit("/", 1)[1], "source_name", "destination_name"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return {tuple(line.split("\t")) for line in listed.stdout.splitlines()}


async def test_an_ordered_endpoint_on_its_lane_leaves_it_at_start(
    legacy: tuple[str, dict[str, str]], receiver: Receiver, tmp_path: Path
) -> None:
    """An ordered endpoint of the version before straight endpoints: a queue of its own its lane copies
    were handed on to. At start the ingest binds that queue to ``events``, writes it leaving its lane and
    sends the fence; the dispatcher that takes it writes it off its lane. Events of one subject then
    reach it, each once, in the order published."""
    amqp_url, env = legacy
    tenant = f"t{uuid.uuid4().hex[:10]}"
    now = datetime.now(UTC)
    endpoint = StoredEndpoint(
        id=f"ep_01ORD{uuid.uuid4().hex[:21].upper()}", tenant=tenant, url=receiver.url("/ordered"),
        event_types=["o.*"], created_at=now, updated_at=now, ordered=True, routed=True, laned=True,
        secrets=[SigningSecret(value=generate_secret(), created_at=now)],
    )  # fmt: skip
    async with Broker(amqp_url, name="old-ingest", connect_timeout_s=10) as broker:
        await topology.declare(broker, topology.Retention())
        async with broker.channel(confirms=True) as channel:
            await topology.provision(channel, endpoint, isolated=True)
            record = EndpointUpserted(change_id=f"chg_{uuid.uuid4().hex}", at=now, endpoint=endpoint)
            body = record.model_dump_json(
                exclude={"endpoint": {"straight", "lane_fence", "left_lane_at"}}
            )  # as the version before wrote it
            await channel.default_exchange.publish(
                aio_pika.Message(body.encode(), content_type="application/json", message_id=record.change_id),
                routing_key=topology.ENDPOINT_LOG,
            )
    running = [services.start(name, env, tmp_path) for name in ("ingest", "dispatcher")]
    try:
        for service in running:
            service.wait_ready()
        ingest, dispatcher = running

        async def left_its_lane() -> bool:
            return any(
                r.get("event") == "endpoint_fence_passed" and r.get("verdict") == "left"
                for r in _records(dispatcher)
            )

        await eventually(left_its_lane, timeout_s=30)
        assert ("events", topology.own_queue(endpoint)) in await bindings(amqp_url)
        assert [r.get("to") for r in _records(ingest) if r.get("event") == "endpoint_upgraded"] == [
            "straight"
        ]
        ids = [f"evt_ordered_{n}" for n in range(20)]
        for event_id in ids:
            await publish_event(amqp_url, {**event(tenant, "o.x", event_id), "subject": "s"}, f"{tenant}.o.x")
        await receiver.wait_for_ids(set(ids), path="/ordered", timeout_s=60)

        # Its lane is still bound for them (no monitor here to unbind it), and it left a moment ago:
        # each event's lane copy is handed on too, a while later, and skipped as a second copy.
        async def second_copies_skipped() -> bool:
            skipped = {
                r.get("event_id")
                for r in _records(dispatcher)
                if r.get("event") == "redelivery_already_settled"
            }
            return skipped >= set(ids)

        await eventually(second_copies_skipped, timeout_s=60)
        assert [r.headers["webhook-id"] for r in receiver.requests if r.path == "/ordered"] == ids

        # Answered slowly, each straight copy is still being attempted when its second copy comes (5 s
        # on): that one is skipped too, not put behind it in its subject and sent once more.
        receiver.responder = lambda _: Reply(delay_s=8)
        slow = [f"evt_slow_{n}" for n in range(3)]
        for n, event_id in enumerate(slow):
            await publish_event(
                amqp_url, {**event(tenant, "o.x", event_id), "subject": f"s{n}"}, f"{tenant}.o.x"
            )

        async def slow_second_copies_skipped() -> bool:
            skipped = {
                r.get("event_id")
                for r in _records(dispatcher)
                if r.get("event") == "redelivery_already_settled" and r.get("outcome") == "taken_straight"
            }
            return skipped >= set(slow)

        await eventually(slow_second_copies_skipped, timeout_s=60)
        await receiver.wait_for_ids(set(slow), path="/ordered", timeout_s=60)
        sent = Counter(r.headers["webhook-id"] for r in receiver.requests if r.path == "/ordered")
        assert {event_id: sent[event_id] for event_id in slow} == dict.fromkeys(slow, 1)
    finally:
        codes = [service.stop() for service in running]
    assert codes == [0, 0]


def _records(service: services.Service) -> list[dict[str, Any]]:
    return [json.loads(line) for line in service.log().splitlines() if line.startswith("{")]
