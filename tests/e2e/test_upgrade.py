"""An endpoint registered by the version before route exchanges keeps working after an upgrade.

Its queue was bound to ``events`` directly and its retries were addressed to the queue. The ingest
gives it route exchanges at start (once, conditionally); nothing queued before is lost, nothing is
delivered twice, and its retries still come back.
"""

from __future__ import annotations

import asyncio
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

from hookline.shared import topology
from hookline.shared.amqp import Broker
from hookline.shared.models import EndpointUpserted, SigningSecret, StoredEndpoint
from hookline.shared.signing import generate_secret

pytestmark = pytest.mark.e2e


async def _register_the_old_way(amqp_url: str, endpoint: StoredEndpoint) -> None:
    """What the previous version's ingest did: a queue bound to ``events`` and to the delay exchange by
    its own name, and an unconditional record without the new fields."""
    async with Broker(amqp_url, name="old-ingest", connect_timeout_s=10) as broker:
        await topology.declare(broker, topology.Retention())
        async with broker.channel(confirms=True) as channel:
            queue = await topology.endpoint_queue_declare(channel, endpoint)
            for key in topology.binding_keys(endpoint.tenant, endpoint.event_types):
                await queue.bind(topology.EVENTS_EXCHANGE, routing_key=key)
            await queue.bind(topology.DELAY_DELIVERY, routing_key=topology.delay_delivery_binding(queue.name))
            record = EndpointUpserted(
                change_id=f"chg_{uuid.uuid4().hex}", at=endpoint.created_at, endpoint=endpoint
            )
            body = record.model_dump_json(
                exclude={
                    "base_version": True,
                    "endpoint": {"queue_generation", "retired_queues", "routed", "version"},
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

        async def upgraded() -> dict[str, Any] | None:
            async with httpx.AsyncClient(
                base_url=ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}
            ) as api:
                shown = (await api.get(f"/v1/endpoints/{endpoint.id}")).json()
            return shown if shown.get("version", 0) >= 2 else None

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
        # The route exchange feeds the queue now: its direct bindings to events are gone.
        bindings = await asyncio.to_thread(
            subprocess.run,
            ["rabbitmqctl", "-q", "list_bindings", "-p", amqp_url.rsplit("/", 1)[1], "source_name", "destination_name"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        pairs = {tuple(line.split("\t")) for line in bindings.stdout.splitlines()}
        queue = topology.endpoint_queue(endpoint.id)
        assert ("events", queue) not in pairs
        assert ("events", topology.route_exchange(endpoint.id)) in pairs
        assert (topology.route_exchange(endpoint.id), queue) in pairs
    finally:
        codes = [service.stop() for service in running]
    assert codes == [0, 0]
