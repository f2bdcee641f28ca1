"""Test-side AMQP helpers: publish as an upstream would, read a stream from its first offset."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import aio_pika


def event(tenant_name: str, event_type: str, event_id: str, **data: object) -> dict[str, object]:
    """An event as an upstream publishes it (DESIGN.md, "The event")."""
    return {
        "id": event_id,
        "type": event_type,
        "tenant": tenant_name,
        "occurred_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "data": data,
    }


async def publish_event(
    amqp_url: str, event: dict[str, Any] | bytes, routing_key: str, **properties: Any
) -> None:
    """Publish to ``events`` exactly as an upstream system would: persistent, confirmed."""
    body = event if isinstance(event, bytes) else json.dumps(event).encode()
    defaults: dict[str, Any] = {
        "content_type": "application/json",
        "delivery_mode": aio_pika.DeliveryMode.PERSISTENT,
    }
    if isinstance(event, dict):
        defaults["message_id"] = event.get("id")
    defaults.update(properties)
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange("events", ensure=False)
        await exchange.publish(aio_pika.Message(body, **defaults), routing_key=routing_key)


async def publish_events_at_once(amqp_url: str, events: list[dict[str, Any]], routing_key: str) -> None:
    """Publish ``events`` to ``events`` together on one channel, each confirmed (a burst, as against
    :func:`publish_event`'s connection per event)."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange("events", ensure=False)
        await asyncio.gather(
            *(
                exchange.publish(
                    aio_pika.Message(
                        json.dumps(event).encode(),
                        content_type="application/json",
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                        message_id=str(event["id"]),
                    ),
                    routing_key=routing_key,
                )
                for event in events
            )
        )


async def read_stream(
    amqp_url: str, stream: str, *, at_least: int = 0, idle_s: float = 1.0, timeout_s: float = 20.0
) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Every message in ``stream`` from the first offset, once ``at_least`` arrived and ``idle_s`` passed quietly."""
    messages: list[aio_pika.abc.AbstractIncomingMessage] = []
    arrived = asyncio.Event()
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=100)
        queue = await channel.declare_queue(stream, passive=True)

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            messages.append(message)
            arrived.set()
            await message.ack()

        await queue.consume(on_message, arguments={"x-stream-offset": "first"})
        async with asyncio.timeout(timeout_s):
            while True:
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), idle_s)
                except TimeoutError:
                    if len(messages) >= at_least:
                        return messages


async def queue_exists(amqp_url: str, name: str) -> bool:
    """A passive declare, on a connection of its own (a missing queue closes the channel)."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        try:
            await channel.declare_queue(name, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return False
        return True
