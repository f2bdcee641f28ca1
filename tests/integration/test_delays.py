"""The TTL delay hierarchy on a real RabbitMQ: order, accuracy, no loss; addressing an endpoint's queue
or its lane through it, a queue gone never losing the copy; and the poison limit."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractConnection, AbstractIncomingMessage, AbstractQueue
from support.amqp import read_stream
from support.broker import Broker as BrokerUnderTest
from support.broker import vhost_of

from hookline.dispatcher.delays import Delays
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.contracts import addressing
from hookline.shared.contracts.deadletters import read_item
from hookline.shared.contracts.headers import Header
from hookline.shared.contracts.models import DeadLetterReason, SigningSecret, StoredEndpoint

pytestmark = [pytest.mark.integration, pytest.mark.long]
NOW = datetime.now(UTC)
ENDPOINT = StoredEndpoint(
    id="ep_01TESTDELAYS00000000000000",
    tenant="acme",
    url="https://example.com/",
    event_types=["#"],
    created_at=NOW,
    updated_at=NOW,
    secrets=[SigningSecret(value="whsec_" + "A" * 44, created_at=NOW)],
    routed=True,
    laned=True,
)


@pytest.fixture
async def broker(amqp_url: str) -> AsyncIterator[Broker]:
    async with Broker(amqp_url, name="test", connect_timeout_s=10) as opened:
        await topology.declare(opened, topology.Retention(event_log_max_age_s=3600))
        yield opened


@pytest.fixture
async def connection(broker: Broker) -> AbstractConnection:
    return await broker.connection()


@pytest.fixture
async def delays(broker: Broker) -> AsyncIterator[Delays]:
    publisher = Publisher(broker)
    yield Delays(publisher)
    await publisher.close()


async def _endpoint_queue(connection: AbstractConnection) -> AbstractQueue:
    """The endpoint's queue of its own, as whoever isolates it declares it."""
    channel = await connection.channel()
    return await topology.declare_own_queue(channel, ENDPOINT)


async def _schedule(delays: Delays, event_id: str, delay_s: int, destination: str | None = None) -> None:
    await delays.schedule(
        b"{}", content_type="application/json", timestamp=None, event_id=event_id, endpoint_id=ENDPOINT.id,
        destination=destination or topology.own_queue(ENDPOINT), next_attempt=2, first_attempt_at_s=time.time(),
        delay_s=delay_s,
    )  # fmt: skip


async def test_mixed_delays_arrive_in_delay_order_through_the_levels_of_their_bits(
    connection: AbstractConnection, delays: Delays, rabbitmq: BrokerUnderTest, amqp_url: str
) -> None:
    """Each delay is spent in the level queues of its set bits (7 s: 4 s, 2 s, 1 s), each once, as the
    broker's x-death says, and each level holds a message for its power of two seconds: that, not a
    stopwatch, is the delay hookline set up. None comes early, and they come in delay order however
    they were published."""
    vhost = vhost_of(amqp_url)
    listed = rabbitmq.ctl(["list_queues", "-p", vhost, "name", "arguments", "--formatter", "json"])
    ttl_ms = {
        queue["name"]: value
        for queue in json.loads(listed)
        for key, _, value in queue["arguments"]
        if key == "x-message-ttl"
    }
    assert all(ttl_ms[topology.delay_level(level)] == 2**level * 1000 for level in range(topology.DELAY_BITS))
    queue = await _endpoint_queue(connection)
    arrived: list[tuple[str, float, list[dict[str, Any]]]] = []
    done = asyncio.Event()

    async def on_message(message: AbstractIncomingMessage) -> None:
        headers = message.headers or {}
        arrived.append((message.message_id or "", time.monotonic(), list(headers.get("x-death") or [])))  # type: ignore[arg-type]
        assert headers[Header.ATTEMPT] == 2
        await message.ack()
        if len(arrived) == 5:
            done.set()

    await queue.consume(on_message)
    published: dict[str, tuple[int, float]] = {}
    for delay_s in (7, 1, 3, 5, 2):
        published[f"evt_{delay_s}"] = (delay_s, time.monotonic())
        await _schedule(delays, f"evt_{delay_s}", delay_s)
    await asyncio.wait_for(done.wait(), 30)

    assert [event_id for event_id, _, _ in arrived] == ["evt_1", "evt_2", "evt_3", "evt_5", "evt_7"]
    for event_id, at, deaths in arrived:
        delay_s, sent_at = published[event_id]
        levels = {topology.delay_level(bit) for bit in range(delay_s.bit_length()) if delay_s >> bit & 1}
        passed = {(str(d["queue"]), str(d["reason"]), d["count"]) for d in deaths}
        assert passed == {(level, "expired", 1) for level in levels}, (event_id, deaths)
        assert at - sent_at >= delay_s - 0.05, (event_id, at - sent_at)  # never early


async def test_a_burst_of_thousands_loses_nothing(connection: AbstractConnection, delays: Delays) -> None:
    queue = await _endpoint_queue(connection)
    count = 3000
    received: set[str] = set()
    done = asyncio.Event()

    async def on_message(message: AbstractIncomingMessage) -> None:
        received.add(message.message_id or "")
        await message.ack()
        if len(received) == count:
            done.set()

    await queue.consume(on_message)
    rng = random.Random(7)
    for start in range(0, count, 250):
        await asyncio.gather(
            *(_schedule(delays, f"evt_{n}", rng.randint(1, 6)) for n in range(start, min(start + 250, count)))
        )
    await asyncio.wait_for(done.wait(), 60)
    assert received == {f"evt_{n}" for n in range(count)}


async def test_a_copy_reaches_the_address_it_names_and_one_whose_queue_is_gone_is_kept(
    connection: AbstractConnection, delays: Delays, broker: Broker
) -> None:
    """Addressed to the endpoint's lane, a retry arrives there naming its endpoint; addressed to a queue
    that is not there (removed once drained), at once or after a delay, it is kept in
    ``hookline.delay.unroutable`` for a dispatcher to forward, never dropped."""
    channel = await connection.channel()
    lane = await channel.get_queue(topology.lane_of(ENDPOINT.tenant), ensure=False)
    unroutable = await channel.get_queue(topology.DELAY_UNROUTABLE, ensure=False)
    await _schedule(delays, "evt_to_lane", 1, destination=topology.lane_of(ENDPOINT.tenant))
    gone = topology.endpoint_queue(ENDPOINT.id, 99)
    await _schedule(delays, "evt_to_gone_later", 1, destination=gone)
    publisher = Publisher(broker)
    try:
        copy = addressing.message(b"{}", event_id="evt_to_gone_now", endpoint_id=ENDPOINT.id)
        await addressing.send(publisher, copy, destination=gone)  # no delay: straight to the last exchange
    finally:
        await publisher.close()

    async def take(queue: AbstractQueue, count: int) -> list[AbstractIncomingMessage]:
        taken: list[AbstractIncomingMessage] = []
        deadline_s = time.monotonic() + 30
        while len(taken) < count and time.monotonic() < deadline_s:
            message = await queue.get(no_ack=True, fail=False, timeout=5)
            if message is None:
                await asyncio.sleep(0.2)
            else:
                taken.append(message)
        return taken

    [in_lane] = await take(lane, 1)
    assert (in_lane.message_id, addressing.endpoint_named(in_lane.headers)) == ("evt_to_lane", ENDPOINT.id)
    kept = await take(unroutable, 2)
    assert sorted(m.message_id or "" for m in kept) == ["evt_to_gone_later", "evt_to_gone_now"]
    assert {topology.delay_destination(m.routing_key or "") for m in kept} == {gone}
    assert {addressing.endpoint_named(m.headers) for m in kept} == {ENDPOINT.id}


async def test_a_message_returned_too_often_becomes_a_delivery_limit_dead_letter(
    connection: AbstractConnection, amqp_url: str
) -> None:
    queue = await _endpoint_queue(connection)
    channel = await connection.channel(publisher_confirms=True)
    await channel.default_exchange.publish(
        aio_pika.Message(b'{"tenant": "acme", "type": "a.b"}', message_id="evt_poison"),
        routing_key=queue.name,
    )
    consumer_channel = await connection.channel()
    poison_queue = await consumer_channel.get_queue(queue.name, ensure=False)
    returns = 0
    while (message := await poison_queue.get(no_ack=False, fail=False, timeout=5)) is not None:
        await message.reject(requeue=True)
        returns += 1
        assert returns <= topology.ENDPOINT_DELIVERY_LIMIT + 1, "the broker never gave up on the message"
    assert returns >= topology.ENDPOINT_DELIVERY_LIMIT

    dead = await read_stream(amqp_url, topology.DEAD_LETTER_STREAM, at_least=1)
    item = read_item(
        dead[0].headers["x-stream-offset"], dead[0].body, dead[0].headers,  # type: ignore[index,arg-type]
        message_id=dead[0].message_id, timestamp=dead[0].timestamp,
    )  # fmt: skip
    assert (item.reason, item.endpoint_id, item.event_id, item.tenant) == (
        DeadLetterReason.DELIVERY_LIMIT, ENDPOINT.id, "evt_poison", "acme",
    )  # fmt: skip
