"""A tenant pattern no endpoint needs is unbound from its lane, and one named again in the moment the
monitor decides is bound back, on a real RabbitMQ with a real change log."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime
from typing import Any

import aio_pika
import pytest
from support.changelog import following

from hookline.health_monitor import bindings as bindings_module
from hookline.health_monitor.bindings import Bindings
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker
from hookline.shared.contracts.models import EndpointDeleted, EndpointUpserted, SigningSecret, StoredEndpoint
from hookline.shared.outbound.signing import generate_secret
from hookline.shared.state import registry

pytestmark = pytest.mark.integration
NOW = datetime.now(UTC)
TENANT = "acme"
PATTERN = "order.*"


def _endpoint(n: int) -> StoredEndpoint:
    return StoredEndpoint(
        id=f"ep_{n:026d}", tenant=TENANT, url="https://example.com/", event_types=[PATTERN], created_at=NOW,
        updated_at=NOW, secrets=[SigningSecret(value=generate_secret(), created_at=NOW)], laned=True,
    )  # fmt: skip


async def _reaches_the_lane(broker: Broker, event_id: str) -> bool:
    """Whether an event published now for the pattern is routed to the tenant's lane."""
    async with broker.channel(confirms=True) as channel:
        events = await channel.get_exchange(topology.EVENTS_EXCHANGE, ensure=False)
        body = json.dumps({"id": event_id, "tenant": TENANT, "type": "order.paid"}).encode()
        await events.publish(aio_pika.Message(body, message_id=event_id), f"{TENANT}.order.paid")
        lane = await channel.get_queue(topology.lane_of(TENANT), ensure=False)
        for _ in range(20):
            message = await lane.get(no_ack=True, fail=False, timeout=5)
            if message is not None and message.message_id == event_id:
                return True
            if message is None:
                await asyncio.sleep(0.05)
    return False


async def _deleted_and_drained(change_log: registry.ChangeLog, endpoint: StoredEndpoint) -> None:
    record = EndpointDeleted(change_id=f"chg_{uuid.uuid4().hex}", at=NOW, endpoint_id=endpoint.id)
    await change_log.write(record, timeout_s=10)
    await change_log.drained(endpoint.id, timeout_s=10)


async def test_a_pattern_nobody_names_is_unbound_after_the_grace(amqp_url: str) -> None:
    async with following(amqp_url, name="test-monitor") as (broker, change_log):
        bindings = Bindings(broker, change_log, grace_s=0, timeout_s=10)
        change_log.registry.subscribe(bindings.on_change)
        first = _endpoint(1)
        await change_log.write(EndpointUpserted(change_id="chg_1", at=NOW, endpoint=first), timeout_s=10)
        async with broker.channel() as channel:
            await topology.bind_patterns(channel, TENANT, [PATTERN])
        assert await _reaches_the_lane(broker, "evt_bound")
        await _deleted_and_drained(change_log, first)
        assert bindings.unneeded == {(TENANT, PATTERN)}
        await bindings.sweep(leader=False)  # a standby decides nothing
        assert await _reaches_the_lane(broker, "evt_still_bound")
        await bindings.sweep(leader=True)
        assert bindings.unneeded == set()
        assert not await _reaches_the_lane(broker, "evt_unbound")


async def test_a_pattern_named_again_while_the_monitor_unbinds_it_is_bound_back(
    amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ingest creates an endpoint of the pattern after the monitor has read the change log and decided
    to unbind, its bind just before the monitor's unbind: the monitor's read after the unbind finds the
    new endpoint and binds the pattern back."""
    async with following(amqp_url, name="test-monitor") as (broker, change_log):
        bindings = Bindings(broker, change_log, grace_s=0, timeout_s=10)
        change_log.registry.subscribe(bindings.on_change)
        first, second = _endpoint(1), _endpoint(2)
        await change_log.write(EndpointUpserted(change_id="chg_1", at=NOW, endpoint=first), timeout_s=10)
        await _deleted_and_drained(change_log, first)
        unbind = topology.unbind_pattern

        async def unbind_after_a_creation(channel: Any, tenant: str, pattern: str) -> None:
            # What another ingest does at that moment: its record, then its (idempotent) bind.
            record = EndpointUpserted(change_id="chg_2", at=NOW, endpoint=second)
            await change_log.write(record, timeout_s=10)
            async with broker.channel() as own:
                await topology.bind_patterns(own, TENANT, [PATTERN])
            await unbind(channel, tenant, pattern)

        monkeypatch.setattr(bindings_module.topology, "unbind_pattern", unbind_after_a_creation)
        await bindings.sweep(leader=True)
        monkeypatch.undo()
        assert await _reaches_the_lane(broker, "evt_for_the_new_endpoint")
