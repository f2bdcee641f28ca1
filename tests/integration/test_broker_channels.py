"""The channels of a broker session take what the broker sends them without waiting for each other:
aiormq hands a channel's frames over through a queue of 10, and a full one stops the connection's reader
for every channel (shared/broker/amqp.py). The effect is measured by ``bench/burst.py``; here, that the bound
is gone on every kind of channel the services open, with the aiormq installed."""

from __future__ import annotations

import aio_pika
import pytest
from support.waiting import eventually

from hookline.shared.broker.amqp import Broker

pytestmark = pytest.mark.integration


async def test_no_channel_of_the_session_bounds_the_frames_it_is_handed(amqp_url: str) -> None:
    async with Broker(amqp_url, name="hookline-test", connect_timeout_s=10) as broker:
        for options in ({"prefetch": 256}, {"confirms": True, "publishing": True}, {}):
            channel = await broker.open_channel(**options)  # type: ignore[arg-type]
            try:
                frames = (await channel.get_underlay_channel()).frames
                assert frames.maxsize == 0, options
            finally:
                await channel.close()


async def test_deliveries_still_arrive_whole_and_in_order_with_the_bound_gone(amqp_url: str) -> None:
    """Deliveries still arrive whole and in order with the bound gone (a prefetch of 64: 192 frames)."""
    async with (
        Broker(amqp_url, name="hookline-test", connect_timeout_s=10) as broker,
        broker.channel(prefetch=64) as channel,
    ):
        queue = await channel.declare_queue(exclusive=True)
        for n in range(200):
            await channel.default_exchange.publish(aio_pika.Message(str(n).encode()), routing_key=queue.name)
        bodies: list[bytes] = []

        async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            bodies.append(message.body)
            await message.ack()

        async def all_taken() -> bool:
            return len(bodies) == 200

        await queue.consume(take)
        await eventually(all_taken, explain=lambda: f"{len(bodies)} of 200 taken")
        assert bodies == [str(n).encode() for n in range(200)]
