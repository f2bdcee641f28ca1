"""Direct routes on a real RabbitMQ with a real change log: an isolated endpoint's queue of its own bound to
``events`` and its lane unbound, then back, while an upstream publishes all along. Every event is on at
least one way in; once a switch is done, only on the one it switched to."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import aio_pika
import pytest
from support.changelog import following

from hookline.health_monitor.bindings import Bindings
from hookline.health_monitor.direct import Direct
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker
from hookline.shared.contracts.models import DirectRoute, EndpointUpserted, SigningSecret, StoredEndpoint
from hookline.shared.outbound.signing import generate_secret
from hookline.shared.state import registry

pytestmark = pytest.mark.integration
NOW = datetime.now(UTC)
TENANT = "acme"
ROUTING_KEY = f"{TENANT}.burst.go"


def _endpoint(n: int, pattern: str) -> StoredEndpoint:
    return StoredEndpoint(
        id=f"ep_{n:026d}", tenant=TENANT, url="https://example.com/", event_types=[pattern], created_at=NOW,
        updated_at=NOW, secrets=[SigningSecret(value=generate_secret(), created_at=NOW)], laned=True,
    )  # fmt: skip


async def _registered(broker: Broker, change_log: registry.ChangeLog, endpoint: StoredEndpoint) -> None:
    """As the ingest registers one: its record, then its lane bound for its patterns."""
    record = EndpointUpserted(change_id=f"chg_{endpoint.id}", at=NOW, endpoint=endpoint)
    await change_log.write(record, timeout_s=10)
    async with broker.channel() as channel:
        await topology.bind_patterns(channel, TENANT, endpoint.event_types)


async def _isolated(broker: Broker, change_log: registry.ChangeLog, endpoint: StoredEndpoint) -> None:
    """As a dispatcher isolates a backlogged one: its queue of its own, then its placement."""
    async with broker.channel() as channel:
        await topology.declare_own_queue(channel, endpoint)
    assert await change_log.place(endpoint.id, isolated=True, reason="backlogged", timeout_s=10)


@contextlib.asynccontextmanager
async def _publishing(broker: Broker) -> AsyncIterator[list[str]]:
    """An upstream publishing events one after another, each confirmed, until the block ends; the ids in
    the order their publishes began."""
    started: list[str] = []

    async def publish() -> None:
        async with broker.channel(confirms=True) as channel:
            events = await channel.get_exchange(topology.EVENTS_EXCHANGE, ensure=False)
            while True:
                event_id = f"evt_{len(started)}"
                started.append(event_id)
                body = json.dumps({"id": event_id, "tenant": TENANT, "type": "burst.go"}).encode()
                await events.publish(aio_pika.Message(body, message_id=event_id), ROUTING_KEY)

    task = asyncio.create_task(publish())
    try:
        await asyncio.sleep(0.2)
        yield started
        await asyncio.sleep(0.2)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _ids_in(broker: Broker, queue_name: str) -> set[str]:
    found: set[str] = set()
    async with broker.channel() as channel:
        queue = await channel.get_queue(queue_name, ensure=False)
        while (message := await queue.get(no_ack=True, fail=False, timeout=5)) is not None:
            assert message.message_id is not None
            found.add(message.message_id)
    return found


async def test_a_direct_route_switched_on_and_off_under_publishing_keeps_every_event(amqp_url: str) -> None:
    async with following(amqp_url, name="test-monitor") as (broker, change_log):
        bindings = Bindings(broker, change_log, grace_s=3600, timeout_s=10)
        direct = Direct(broker, change_log, bindings, lambda: True, timeout_s=10)
        burst = _endpoint(1, "burst.*")
        await _registered(broker, change_log, burst)
        await _isolated(broker, change_log, burst)
        own = topology.own_queue(burst)
        async with _publishing(broker) as started:
            await direct.reconcile()  # alone in its tenant, isolated: routed directly
            on = len(started)
            route = change_log.registry.placements.direct(burst)
            assert route == DirectRoute(queue=own, patterns=("burst.*",))
            assert change_log.registry.subscriptions.patterns_needed(TENANT) == set()
            await asyncio.sleep(0.5)
            # Another endpoint of the tenant names an overlapping pattern: its lane is bound for it, and
            # this endpoint's route goes (the lane would hand its copies on besides).
            off_from = len(started)
            await _registered(broker, change_log, _endpoint(2, "burst.other"))
            await direct.reconcile()
            off = len(started)
            assert change_log.registry.placements.direct(burst) is None
            assert change_log.registry.subscriptions.patterns_needed(TENANT) == {"burst.*", "burst.other"}
        published = list(started[:-1])  # the last one's publish may not have ended
        in_lane = await _ids_in(broker, topology.lane_of(TENANT))
        in_own = await _ids_in(broker, own)
        assert set(published) <= in_lane | in_own, "an event reached neither way in"
        assert not in_lane & set(published[on:off_from]), "routed directly, the lane got some"
        assert not in_own & set(published[off:]), "switched off, the queue of its own got some"
        assert set(published[on:off_from]) <= in_own
        assert set(published[off:]) <= in_lane
        # Both ways only while a switch was under way.
        both = in_lane & in_own
        assert both <= set(published[:on]) | set(published[off_from:off]), sorted(both)


async def test_a_route_recorded_but_not_bound_is_bound_before_its_lane_is_unbound(amqp_url: str) -> None:
    """A monitor stopped between recording a route and binding it: the next one, unbinding the pattern
    from the lane (nobody needs it there by the record), binds the route first."""
    async with following(amqp_url, name="test-monitor") as (broker, change_log):
        bindings = Bindings(broker, change_log, grace_s=0, timeout_s=10)
        change_log.registry.subscribe(bindings.on_change)
        burst = _endpoint(3, "burst.*")
        await _registered(broker, change_log, burst)
        await _isolated(broker, change_log, burst)
        own = topology.own_queue(burst)
        assert await change_log.route(burst.id, DirectRoute(queue=own, patterns=("burst.*",)), timeout_s=10)
        assert bindings.unneeded == {(TENANT, "burst.*")}
        await bindings.sweep(leader=True)
        async with _publishing(broker) as started:
            pass
        published = set(started[:-1])
        assert published
        assert published <= await _ids_in(broker, own)
        assert not published & await _ids_in(broker, topology.lane_of(TENANT))


async def test_an_endpoint_routed_directly_goes_back_to_its_lane_only_once_switched_off(
    amqp_url: str,
) -> None:
    async with following(amqp_url, name="test-monitor") as (broker, change_log):
        burst = _endpoint(4, "burst.*")
        await _registered(broker, change_log, burst)
        await _isolated(broker, change_log, burst)
        route = DirectRoute(queue=topology.own_queue(burst), patterns=("burst.*",))
        assert await change_log.route(burst.id, route, timeout_s=10)
        with pytest.raises(ValueError, match="routed directly"):
            await change_log.place(burst.id, isolated=False, reason="", timeout_s=10)
        # Isolated again for another reason, the route stays.
        assert await change_log.place(burst.id, isolated=True, reason="breaker_open", timeout_s=10)
        assert change_log.registry.placements.direct(burst) == route
        assert await change_log.route(burst.id, None, timeout_s=10)
        assert await change_log.place(burst.id, isolated=False, reason="", timeout_s=10)
