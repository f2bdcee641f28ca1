"""Several broker addresses (a cluster's nodes): the session connects to one that answers and, when its
node goes, moves to another (two proxies in front of the real RabbitMQ stand for two nodes); a nacked
publish does not leave its channel in use; and an idle session's publishing connection comes back."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import aiormq
import pytest
from support.broker import Broker as BrokerUnderTest
from support.broker import vhost_of
from support.proxy import TcpProxy
from support.waiting import eventually

from hookline.shared.broker.amqp import BROKER_ERRORS, NACKED_CHANNELS_REOPENED, Broker, Publisher

pytestmark = pytest.mark.integration


def dead_address() -> str:
    """A local port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


async def round_trip(broker: Broker) -> bytes:
    async with broker.channel() as channel:
        queue = await channel.declare_queue(exclusive=True)
        await channel.default_exchange.publish(aio_pika.Message(b"ping"), routing_key=queue.name)
        message = await eventually(lambda: queue.get(fail=False))
        await message.ack()
        return message.body


async def after_reconnecting(broker: Broker) -> bytes:
    """A round trip once the session has noticed the loss and reconnected (callers retry, as the
    services' loops do)."""

    async def attempt() -> bytes | None:
        try:
            return await round_trip(broker)
        except BROKER_ERRORS:
            return None

    return await eventually(attempt)


async def test_a_dead_first_address_is_skipped(amqp_url: str) -> None:
    parts = urlsplit(amqp_url)
    dead = parts._replace(netloc=f"{parts.netloc.rpartition('@')[0]}@{dead_address()}").geturl()
    async with Broker(f"{dead},{amqp_url}", name="hookline-test", connect_timeout_s=10) as broker:
        assert broker.connected
        assert await round_trip(broker) == b"ping"


async def test_when_its_node_goes_the_session_moves_to_another(amqp_url: str) -> None:
    broker_address = urlsplit(amqp_url)
    host, port = broker_address.hostname or "127.0.0.1", broker_address.port or 5672
    async with TcpProxy(host, port) as first, TcpProxy(host, port) as second:
        nodes = f"{first.url_for(amqp_url)},{second.url_for(amqp_url)}"
        async with Broker(nodes, name="hookline-test", connect_timeout_s=10) as broker:
            assert await round_trip(broker) == b"ping"
            assert first.connections == 2  # both of the session's connections went to the first node
            assert second.connections == 0
            first.refuse(True)  # the first node is gone, and stays gone
            await first.cut()
            assert await after_reconnecting(broker) == b"ping"  # through the second
            assert second.connections >= 1
            assert first.connections == 0


async def test_a_nacked_publish_gets_the_next_publish_a_fresh_channel(amqp_url: str) -> None:
    """A nack (here: a full queue that rejects publishes) raises, and the channel that got it is not
    used again: after a node dies RabbitMQ 3.10 goes on nacking such a channel for seconds."""
    async with Broker(amqp_url, name="hookline-test", connect_timeout_s=10) as broker:
        async with broker.channel() as admin:
            await admin.declare_queue(
                "full",
                durable=True,
                arguments={"x-queue-type": "classic", "x-max-length": 0, "x-overflow": "reject-publish"},
            )
            await admin.declare_queue("fine", durable=True, arguments={"x-queue-type": "quorum"})
        publisher = Publisher(broker)
        await publisher.publish(aio_pika.Message(b"1"), exchange="", routing_key="fine")
        first = publisher._channel
        before = NACKED_CHANNELS_REOPENED._value.get()
        with pytest.raises(aiormq.exceptions.DeliveryError):
            await publisher.publish(aio_pika.Message(b"2"), exchange="", routing_key="full")
        assert NACKED_CHANNELS_REOPENED._value.get() == before + 1
        await publisher.publish(aio_pika.Message(b"3"), exchange="", routing_key="fine")
        assert publisher._channel is not first
        await publisher.close()
        async with broker.channel() as admin:
            assert (await admin.declare_queue("fine", passive=True)).declaration_result.message_count == 2


async def test_an_idle_publishing_connection_comes_back_after_aiormq_cancelled_the_pulse(
    rabbitmq: BrokerUnderTest, amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the pulse reopens the publishing connection of a session that publishes seldom (an ingest
    fed over HTTP). aiormq, dropping a connection that missed its heartbeats, cancels whatever waits on
    it: the pulse opening its channel then sees a CancelledError although nobody cancelled it (the
    fault suite, once: the ingest's publishing connection never came back). That moment cannot be
    timed from outside, so here the pulse's first open raises it; the pulse must live on."""
    real_open_channel = Broker.open_channel
    cancelled: list[bool] = []

    async def open_channel(self: Broker, **options: Any) -> aio_pika.abc.AbstractChannel:
        if options.get("publishing") and not cancelled:
            cancelled.append(True)
            raise asyncio.CancelledError  # as aiormq's Channel.Open on a connection it dropped
        return await real_open_channel(self, **options)

    monkeypatch.setattr(Broker, "open_channel", open_channel)
    name = "hookline-test-idle"
    async with Broker(amqp_url, name=name, connect_timeout_s=10) as broker:

        async def pulse_cancelled() -> bool:
            return bool(cancelled)

        await eventually(pulse_cancelled)
        vhost = vhost_of(amqp_url)
        connections = await rabbitmq.connections(vhost)
        await rabbitmq.ctl_async(["close_connection", connections[f"{name}:{os.getpid()}:publish"], "test"])

        async def publishing(connected: bool) -> bool:
            return broker.publishing_connected is connected

        await eventually(lambda: publishing(False))
        await eventually(lambda: publishing(True), explain=lambda: "the publishing connection stayed closed")
