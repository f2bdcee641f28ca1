"""What a service's broker session does under a real resource alarm, and what the stream caps keep.

The alarm is raised on the real broker (``set_vm_memory_high_watermark``); it blocks every vhost's
publishers, so each test keeps it short and the helper always clears it.
"""

from __future__ import annotations

import asyncio
import json
import shlex

import aio_pika
import pytest
import structlog
from aio_pika.abc import AbstractIncomingMessage
from support import broker as test_broker
from support.waiting import eventually

from hookline.shared.broker import topology
from hookline.shared.broker.amqp import CALL_TIMEOUT_S, Broker, BrokerBlockedError, Publisher

pytestmark = [pytest.mark.integration, pytest.mark.serial]


async def test_an_alarm_refuses_publishes_at_once_and_consumers_keep_acking(
    amqp_url: str, rabbitmq: test_broker.Broker
) -> None:
    async with Broker(amqp_url, name="test-pressure", connect_timeout_s=10) as broker:
        async with broker.channel() as channel:
            queue = await channel.declare_queue(
                "pressure.work", durable=True, arguments={"x-queue-type": "quorum"}
            )
        refusing, waiting = Publisher(broker), Publisher(broker, wait_unblocked=True)
        for n in range(50):
            await refusing.publish(aio_pika.Message(str(n).encode()), exchange="", routing_key=queue.name)
        assert not broker.blocked
        assert broker.problems() == []

        acked: list[bytes] = []
        async with rabbitmq.alarm("memory"):
            # An idle session hears of the alarm from its pulse, before anything real is published.
            await eventually(lambda: _true(broker.blocked), timeout_s=10)
            assert "refusing publishes" in broker.problems()[0]

            # Refused at once, not after a deadline: BrokerBlockedError is raised before a publish starts
            # (one that ran into its deadline would raise TimeoutError).
            with pytest.raises(BrokerBlockedError):
                await refusing.publish(aio_pika.Message(b"refused"), exchange="", routing_key=queue.name)
            held = asyncio.create_task(
                waiting.publish(aio_pika.Message(b"held"), exchange="", routing_key=queue.name)
            )

            # The consuming connection is not blocked: every message queued before the alarm is
            # delivered and acked while it lasts.
            async def on_message(message: AbstractIncomingMessage) -> None:
                acked.append(message.body)
                await message.ack()

            async with broker.channel(prefetch=5) as consuming:
                consumer = await consuming.get_queue(queue.name, ensure=False)
                tag = await consumer.consume(on_message)
                await eventually(lambda: _true(len(acked) == 50))
                await consumer.cancel(tag)
            assert not held.done(), "a waiting publish waits for as long as the alarm lasts"

        await asyncio.wait_for(held, timeout=CALL_TIMEOUT_S)
        await eventually(lambda: _true(not broker.blocked and broker.problems() == []))
        async with broker.channel() as channel:
            declared = await channel.declare_queue(queue.name, passive=True)
            assert declared.declaration_result.message_count == 1  # "held", and not "refused"
        await refusing.close()
        await waiting.close()


async def test_a_byte_cap_truncates_the_event_log_from_its_oldest_end(amqp_url: str) -> None:
    """Twelve segments' worth through a log capped at four: the oldest events are gone, the newest kept."""
    retention = topology.Retention(event_log_max_age_s=3600, event_log_max_bytes=10_000_000)
    arguments = retention.arguments()[topology.EVENT_LOG]
    segment_bytes = arguments["x-stream-max-segment-size-bytes"]
    assert segment_bytes == 1_000_000  # a twentieth of the cap, at least 1 MB
    async with Broker(amqp_url, name="test-caps", connect_timeout_s=10) as broker:
        await topology.declare(broker, retention)
        publisher = Publisher(broker)
        body = b"x" * 100_000
        for n in range(200):  # 20 MB: twice the cap
            await publisher.publish(
                aio_pika.Message(body, message_id=f"evt_{n}"),
                exchange=topology.EVENTS_EXCHANGE,
                routing_key="t.a",
            )
        await publisher.close()

        async def first_kept() -> str | None:
            async with broker.channel(prefetch=1) as channel:
                stream = await channel.get_queue(topology.EVENT_LOG, ensure=False)
                found: asyncio.Future[str] = asyncio.get_running_loop().create_future()

                async def on_message(message: AbstractIncomingMessage) -> None:
                    if not found.done():
                        found.set_result(message.message_id or "")

                await stream.consume(on_message, arguments={"x-stream-offset": "first"})
                first = await asyncio.wait_for(found, timeout=10)
            return first if first != "evt_0" else None

        first = await eventually(first_kept)
        assert int(first.removeprefix("evt_")) >= 80, f"about 10 MB should be gone; the log starts at {first}"


async def test_a_stream_made_without_caps_is_used_as_it_is_with_the_policy_that_would_cap_it(
    amqp_url: str,
) -> None:
    """An event log declared by an earlier version (age only) does not stop a service: the log says
    which policy gives it the cap."""
    async with Broker(amqp_url, name="test-upgrade-caps", connect_timeout_s=10) as broker:
        async with broker.channel() as channel:
            await channel.declare_queue(
                topology.EVENT_LOG, durable=True, arguments={"x-queue-type": "stream", "x-max-age": "604800s"}
            )
        with structlog.testing.capture_logs() as logs:
            await topology.declare(broker, topology.Retention())
    [warning] = [entry for entry in logs if entry["event"] == "stream_retention_differs"]
    assert warning["stream"] == topology.EVENT_LOG
    assert "x-max-length-bytes" in warning["detail"]
    policy = warning["policy"]
    assert policy.startswith(f"rabbitmqctl set_policy -p {broker.vhost} --apply-to queues ")
    definition = json.loads(shlex.split(policy)[-1])
    assert definition == {
        "max-age": "604800s",
        "max-length-bytes": 20_000_000_000,
        "stream-max-segment-size-bytes": 500_000_000,
    }


async def _true(value: bool) -> bool:
    return value
