"""The TTL delay hierarchy on a real RabbitMQ: order, accuracy, no loss; and the poison limit."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import pytest
from aio_pika.abc import AbstractConnection, AbstractIncomingMessage, AbstractQueue
from support.amqp import read_stream
from support.broker import Broker as BrokerUnderTest

from hookline.dispatcher.delays import Delays
from hookline.shared import topology
from hookline.shared.amqp import Broker, Publisher
from hookline.shared.deadletters import read_item
from hookline.shared.headers import Header
from hookline.shared.models import DeadLetterReason, SigningSecret, StoredEndpoint

pytestmark = pytest.mark.integration
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
    """The endpoint's queue, fed through its route exchange, as the ingest provisions it."""
    channel = await connection.channel()
    await topology.provision(channel, ENDPOINT)
    return await channel.get_queue(topology.endpoint_queue(ENDPOINT.id), ensure=False)


async def _schedule(delays: Delays, event_id: str, delay_s: int) -> None:
    await delays.schedule(
        b"{}", content_type="application/json", timestamp=None, event_id=event_id,
        destination=topology.retry_destination(ENDPOINT), next_attempt=2, first_attempt_at_s=time.time(),
        delay_s=delay_s,
    )  # fmt: skip


async def test_mixed_delays_arrive_in_delay_order_through_the_levels_of_their_bits(
    connection: AbstractConnection, delays: Delays, rabbitmq: BrokerUnderTest, amqp_url: str
) -> None:
    """Each delay is spent in the level queues of its set bits (7 s: 4 s, 2 s, 1 s), each once, as the
    broker's x-death says, and each level holds a message for its power of two seconds: that, not a
    stopwatch, is the delay hookline set up. None comes early, and they come in delay order however
    they were published."""
    vhost = unquote(urlsplit(amqp_url).path.lstrip("/"))
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
