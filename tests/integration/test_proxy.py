"""The fault proxy between a client and the real RabbitMQ: it forwards, cuts, stalls, resumes and refuses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel
from support.proxy import TcpProxy
from support.waiting import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
async def proxy(amqp_url: str) -> AsyncIterator[TcpProxy]:
    broker = urlsplit(amqp_url)
    async with TcpProxy(broker.hostname or "127.0.0.1", broker.port or 5672) as running:
        yield running
    assert running.connections == 0


async def _round_trip(channel: AbstractChannel, body: bytes) -> None:
    queue = await channel.declare_queue(exclusive=True)
    await channel.default_exchange.publish(aio_pika.Message(body), routing_key=queue.name)
    message = await eventually(lambda: queue.get(fail=False))
    assert message.body == body
    await message.ack()


def test_url_for_keeps_everything_but_the_address() -> None:
    proxy = TcpProxy("127.0.0.1", 5672)
    proxy.port = 40001
    assert (
        proxy.url_for("amqp://us%40er:p%3Ass@rabbit.example:5671/my%2Fvhost?heartbeat=2")
        == "amqp://us%40er:p%3Ass@127.0.0.1:40001/my%2Fvhost?heartbeat=2"
    )
    assert proxy.url_for("amqp://rabbit/") == "amqp://127.0.0.1:40001/"


async def test_forwards_a_connection_both_ways(proxy: TcpProxy, amqp_url: str) -> None:
    connection = await aio_pika.connect(proxy.url_for(amqp_url), timeout=10)
    async with connection:
        assert proxy.connections == 1
        await _round_trip(await connection.channel(), b"through the proxy")
    await eventually(lambda: _async(proxy.connections == 0))


async def test_cut_closes_the_client_and_later_connections_work(proxy: TcpProxy, amqp_url: str) -> None:
    connection = await aio_pika.connect(proxy.url_for(amqp_url), timeout=10)
    async with connection:
        channel = await connection.channel()
        closed_by: list[BaseException | None] = []
        connection.close_callbacks.add(lambda _, exc: closed_by.append(exc))

        await proxy.cut()

        await asyncio.wait_for(channel.closed(), 10)
        await eventually(lambda: _async(bool(closed_by)))
        # A network failure, not a clean close: the callback gets the error. (aio_pika's own
        # ``connection.is_closed`` stays False after a broken connection; ``connected`` is cleared.)
        assert isinstance(closed_by[0], aio_pika.exceptions.AMQPConnectionError), closed_by
        assert not connection.connected.is_set()
        assert proxy.connections == 0

    again = await aio_pika.connect(proxy.url_for(amqp_url), timeout=10)
    async with again:
        await _round_trip(await again.channel(), b"after the cut")


async def test_stall_holds_a_confirmed_publish_until_resumed(proxy: TcpProxy, amqp_url: str) -> None:
    connection = await aio_pika.connect(proxy.url_for(amqp_url), timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.declare_queue(exclusive=True)

        proxy.stall()
        publishing = asyncio.create_task(
            channel.default_exchange.publish(aio_pika.Message(b"held"), routing_key=queue.name)
        )
        done, _ = await asyncio.wait({publishing}, timeout=1)
        assert not done, "a publish confirmed through a stalled proxy"

        proxy.resume()
        await asyncio.wait_for(publishing, 10)
        message = await eventually(lambda: queue.get(fail=False))
        assert message.body == b"held"
        await message.ack()


async def test_refuse_makes_the_broker_unreachable(proxy: TcpProxy, amqp_url: str) -> None:
    proxy.refuse(True)
    # A raw socket rather than aio_pika.connect: a client torn down half way through its handshake leaves
    # objects whose late errors pytest reports against whichever test happens to collect them.
    assert await _reset_before_any_answer(proxy.port)
    assert proxy.connections == 0

    proxy.refuse(False)
    connection = await aio_pika.connect(proxy.url_for(amqp_url), timeout=10)
    async with connection:
        await _round_trip(await connection.channel(), b"reachable again")


async def _reset_before_any_answer(port: int) -> bool:
    """True when a connection to ``port`` is dropped without a byte of the broker's answer."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionError:
        return True
    try:
        writer.write(b"AMQP\x00\x00\x09\x01")
        return await asyncio.wait_for(reader.read(1), timeout=5) == b""
    except ConnectionError:
        return True
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _async(value: bool) -> bool:
    return value
