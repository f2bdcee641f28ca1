"""Acks in batches on a real RabbitMQ quorum queue, consumed as the dispatcher consumes: every settled message acked, none acked early, a held
delivery never holding the others' prefetch window, and fewer ack frames than messages."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractQueue
from support.waiting import eventually

from hookline.dispatcher import consumed
from hookline.dispatcher.acks import Acks
from hookline.dispatcher.consumed import Delivery

pytestmark = pytest.mark.integration


@pytest.fixture
async def connection(amqp_url: str) -> AsyncIterator[aio_pika.abc.AbstractConnection]:
    async with await aio_pika.connect(amqp_url) as opened:
        yield opened


async def _queue_with(connection: aio_pika.abc.AbstractConnection, count: int) -> AbstractQueue:
    channel = await connection.channel()
    queue = await channel.declare_queue(
        f"test.acks.{uuid.uuid4().hex[:8]}", durable=True, arguments={"x-queue-type": "quorum"}
    )
    for n in range(count):
        await channel.default_exchange.publish(
            aio_pika.Message(b"{}", message_id=str(n), delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=queue.name,
        )
    return queue


async def _consume(
    connection: aio_pika.abc.AbstractConnection,
    queue_name: str,
    prefetch: int,
    on_message: Callable[[Delivery], Awaitable[None]],
    *,
    nacks_wait_for: asyncio.Event | None = None,
) -> tuple[AbstractChannel, list[tuple[int, bool]]]:
    """Consume with ``on_message``; returns the channel and the ack frames sent on it (tag, multiple).
    With ``nacks_wait_for``, a nack waits for that event before it is written (no room for it in the
    connection's write queue)."""
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=prefetch)
    frames: list[tuple[int, bool]] = []
    raw = await channel.get_underlay_channel()
    send = raw.basic_ack

    async def counted(delivery_tag: int, multiple: bool = False, **kwargs: Any) -> None:
        frames.append((delivery_tag, multiple))
        await send(delivery_tag, multiple=multiple, **kwargs)

    raw.basic_ack = counted  # type: ignore[method-assign]  # a spy on the real channel's frames
    send_nack = raw.basic_nack

    async def delayed(delivery_tag: int, multiple: bool = False, **kwargs: Any) -> None:
        if nacks_wait_for is not None:
            await nacks_wait_for.wait()
        await send_nack(delivery_tag, multiple=multiple, **kwargs)

    raw.basic_nack = delayed  # type: ignore[method-assign]
    await consumed.consume(channel, queue_name, on_message, timeout_s=10)
    return channel, frames


async def _ready_after_close(
    connection: aio_pika.abc.AbstractConnection, channel: AbstractChannel, queue_name: str
) -> int:
    """Messages in the queue once the consumer's channel is closed: whatever it left unacked is back."""
    await channel.close()
    probe = await connection.channel()

    async def consumer_gone() -> int | None:
        # A quorum queue drops a closed channel's consumer and returns what it held in one command of
        # its log: once the consumer is gone, the count includes what came back.
        ok = (await probe.declare_queue(queue_name, passive=True)).declaration_result
        return None if ok.consumer_count else ok.message_count or 0

    count = await eventually(consumer_gone)
    await probe.queue_delete(queue_name)
    await probe.close()
    return count


async def test_settled_out_of_order_every_message_is_acked_in_fewer_frames(
    connection: aio_pika.abc.AbstractConnection,
) -> None:
    count = 300
    queue = await _queue_with(connection, count)
    acks = Acks()
    settled: set[str] = set()

    async def on_message(message: Delivery) -> None:
        acks.delivered(message)
        await asyncio.sleep(random.uniform(0, 0.01))
        await acks.ack(message)
        settled.add(message.message_id or "")

    channel, frames = await _consume(connection, queue.name, 32, on_message)
    await eventually(lambda: asyncio.sleep(0, len(settled) == count))
    await acks.flush()
    assert await _ready_after_close(connection, channel, queue.name) == 0
    assert any(multiple for _, multiple in frames)
    assert len(frames) < count / 2


async def test_a_held_delivery_does_not_hold_the_window_and_is_never_acked_with_the_rest(
    connection: aio_pika.abc.AbstractConnection,
) -> None:
    """The first message is held (a slow endpoint); the rest, more than the prefetch window, flow past
    it. Once the channel closes, the held one (never settled) is back in the queue: nothing acked it."""
    queue = await _queue_with(connection, 30)
    acks = Acks()
    held = asyncio.Event()
    settled: list[str] = []

    async def on_message(message: Delivery) -> None:
        acks.delivered(message)
        if message.message_id == "0":
            await held.wait()
            return  # handled without settling (cancelled at a shutdown, say)
        await acks.ack(message)
        settled.append(message.message_id or "")

    channel, frames = await _consume(connection, queue.name, 5, on_message)
    await eventually(lambda: asyncio.sleep(0, len(settled) == 29))
    held.set()
    await acks.flush()
    assert not any(multiple for _, multiple in frames)  # tag 1 was outstanding throughout
    assert await _ready_after_close(connection, channel, queue.name) == 1


async def test_a_nack_in_the_middle_neither_blocks_nor_is_covered(
    connection: aio_pika.abc.AbstractConnection,
) -> None:
    queue = await _queue_with(connection, 50)
    acks = Acks()
    seen: dict[str, int] = {}

    async def on_message(message: Delivery) -> None:
        acks.delivered(message)
        key = message.message_id or ""
        seen[key] = seen.get(key, 0) + 1
        if key == "10" and seen[key] == 1:
            await acks.nack(message, requeue=True)  # handed back once, delivered again, then acked
            return
        await acks.ack(message)
        with pytest.raises(aio_pika.exceptions.MessageProcessError):
            await acks.nack(message, requeue=True)  # settled already: refused, as aio-pika refuses it
        with pytest.raises(aio_pika.exceptions.MessageProcessError):
            await acks.ack(message)

    channel, _ = await _consume(connection, queue.name, 16, on_message)
    await eventually(lambda: asyncio.sleep(0, len(seen) == 50 and seen["10"] == 2))
    await acks.flush()
    assert await _ready_after_close(connection, channel, queue.name) == 0


async def test_a_delivery_left_unsettled_is_never_acked_by_a_later_flush(
    connection: aio_pika.abc.AbstractConnection,
) -> None:
    """A handling that ends without settling (cancelled at shutdown) leaves its message unacked; the
    final flush acks the settled ones after it, never it (it was lost when a flush covered it)."""
    queue = await _queue_with(connection, 10)
    acks = Acks(hold_s=60)  # nothing is acked alone before the flush
    settled: list[str] = []

    async def on_message(message: Delivery) -> None:
        acks.delivered(message)
        if message.message_id == "0":
            return
        await acks.ack(message)
        settled.append(message.message_id or "")

    channel, frames = await _consume(connection, queue.name, 10, on_message)
    await eventually(lambda: asyncio.sleep(0, len(settled) == 9))
    await acks.flush()
    assert not any(multiple for _, multiple in frames)
    assert await _ready_after_close(connection, channel, queue.name) == 1


async def test_a_nack_waiting_to_be_written_is_never_overtaken_by_an_ack_covering_it(
    connection: aio_pika.abc.AbstractConnection,
) -> None:
    """Under load aiormq's write queue is full and a writer waiting for room can be overtaken by a later
    one. Here the nack of message "3" waits (as it would behind a full queue) while the messages around it
    are acked: an ack ``multiple`` sent meanwhile would ack 3 at the broker (lost instead of handed back),
    and the nack then closed the channel on an unknown delivery tag (a fault-suite run lost 12 events)."""
    queue = await _queue_with(connection, 20)
    acks = Acks(hold_s=60)  # everything acked after the nack goes in one multiple ack
    nack_waits = asyncio.Event()
    seen: dict[str, int] = {}
    acked: list[str] = []

    async def on_message(message: Delivery) -> None:
        acks.delivered(message)
        key = message.message_id or ""
        seen[key] = seen.get(key, 0) + 1
        if key == "3" and seen[key] == 1:
            await acks.nack(message, requeue=True)
            return
        await acks.ack(message)
        acked.append(key)

    channel, frames = await _consume(connection, queue.name, 20, on_message, nacks_wait_for=nack_waits)
    await eventually(lambda: asyncio.sleep(0, len(acked) == 19))
    await acks.flush()  # everything settled so far goes out now, with the nack still waiting
    # Message "3" is the fourth delivery: tag 4.
    assert (3, True) in frames
    assert all(tag < 4 for tag, multiple in frames if multiple), "an ack covered tag 4 before its nack"
    nack_waits.set()
    await eventually(lambda: asyncio.sleep(0, seen.get("3") == 2 and len(acked) == 20))
    await acks.flush()
    assert not channel.is_closed  # no precondition_failed on an unknown delivery tag
    assert (21, True) in frames  # the run went on over the nacked tag once its frame was written
    assert await _ready_after_close(connection, channel, queue.name) == 0


async def test_a_multiple_ack_never_covers_a_tag_this_process_did_not_see(
    connection: aio_pika.abc.AbstractConnection,
) -> None:
    """A delivery that never reached the handler (a client library dropping it, say) stays unacked at
    the broker: the acks after it go one by one, and it is back in the queue once the channel closes."""
    queue = await _queue_with(connection, 10)
    acks = Acks(hold_s=0.0)
    acked: list[str] = []

    async def on_message(message: Delivery) -> None:
        if message.message_id == "4":
            return  # never registered, never settled
        acks.delivered(message)
        await acks.ack(message)
        acked.append(message.message_id or "")

    channel, frames = await _consume(connection, queue.name, 10, on_message)
    await eventually(lambda: asyncio.sleep(0, len(acked) == 9))
    await acks.flush()
    assert all(tag < 5 for tag, multiple in frames if multiple)
    assert await _ready_after_close(connection, channel, queue.name) == 1
