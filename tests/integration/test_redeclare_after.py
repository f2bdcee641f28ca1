"""What ``topology.REDECLARE_AFTER_S`` relies on: a consumed quorum queue deleted by hand has told its
consumer (basic.cancel) by the time hookline declares it again, so that the queue declared again starts
with no consumer, and the one who was consuming it attaches anew and gets what is published there.

Declared again at once instead (the leading monitor used to, on the poll that found it missing), RabbitMQ
3.10 gave the new queue the old consumer back: counted by the broker, so the dispatchers' check with the
broker found nothing wrong, and handed messages its channel never passed on
(``tests/e2e/test_monitors_and_repair.py`` failed so in CI)."""

from __future__ import annotations

import asyncio

import aio_pika
import pytest
from support import broker as test_broker
from support.waiting import eventually

from hookline.shared.broker import topology
from hookline.shared.broker.amqp import on_cancel

pytestmark = pytest.mark.integration
ARGUMENTS = {"x-queue-type": "quorum", "x-single-active-consumer": True}


async def test_a_deleted_queue_declared_again_after_the_wait_has_told_its_consumer(
    amqp_url: str, rabbitmq: test_broker.Broker
) -> None:
    vhost = test_broker.vhost_of(amqp_url)
    cancelled: list[str] = []
    delivered: list[str] = []
    async with (
        await aio_pika.connect(amqp_url) as consuming,
        await aio_pika.connect(amqp_url) as repairing,
    ):
        channel = await consuming.channel()
        queue = await channel.declare_queue("redeclare.q", durable=True, arguments=ARGUMENTS)

        async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            delivered.append(message.body.decode())
            await message.ack()

        await queue.consume(take)
        await on_cancel(channel, lambda frame: cancelled.append(frame.consumer_tag or ""))

        await rabbitmq.ctl_async(["delete_queue", "-p", vhost, "redeclare.q"])
        await asyncio.sleep(topology.REDECLARE_AFTER_S)  # as the monitor and the dispatchers wait
        repair = await repairing.channel()
        again = await repair.declare_queue("redeclare.q", durable=True, arguments=ARGUMENTS)

        assert cancelled, "the consumer was not told its queue was deleted"
        assert again.declaration_result.consumer_count == 0, "the queue declared again took the old consumer"
        # The one told attaches anew, and what is published there reaches it.
        await (await channel.declare_queue("redeclare.q", passive=True)).consume(take)
        await repair.default_exchange.publish(aio_pika.Message(b"after"), routing_key="redeclare.q")
        await eventually(lambda: asyncio.sleep(0, result=delivered == ["after"]))
