"""The bare minimum a dispatcher must do, as a ceiling: consume a persistent message from a quorum
queue, sign it, POST it with aiohttp, ack. No validation, no logging, no telemetry.

Usage: python -m bench.baseline AMQP_URL N PREFETCH URL [backlog|live]  → prints deliveries/s as JSON.
``backlog`` (the default) publishes the N messages first, then consumes them. ``live`` consumes while
another process publishes: it prints ``ready`` once its consumer is attached, and the caller publishes
the N messages (ids ``b<n>``) to the queue ``bench.baseline`` and rates the arrivals at its receiver, as
it rates hookline's live runs.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import sys
import time

import aio_pika
import aiohttp
import uvloop

KEY = b"k" * 32


QUEUE = "bench.baseline"
BODY = json.dumps({"id": "x", "data": {"x": "a" * 1000}}).encode()


async def publish(channel: aio_pika.abc.AbstractChannel, count: int) -> None:
    """``count`` persistent messages to the queue, 500 confirms in flight at most."""
    pending = []
    for n in range(count):
        message = aio_pika.Message(BODY, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=f"b{n}")
        pending.append(channel.default_exchange.publish(message, routing_key=QUEUE))
        if len(pending) >= 500:
            await asyncio.gather(*pending)
            pending = []
    await asyncio.gather(*pending)


async def main(amqp_url: str, count: int, prefetch: int, url: str, mode: str) -> None:
    connection = await aio_pika.connect_robust(amqp_url)
    channel = await connection.channel()
    queue = await channel.declare_queue(QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
    await queue.purge()
    if mode == "backlog":
        await publish(channel, count)

    consumer_channel = await connection.channel()
    await consumer_channel.set_qos(prefetch_count=prefetch)
    consumer_queue = await consumer_channel.get_queue(queue.name)
    done = asyncio.Event()
    delivered = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=prefetch)) as session:

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal delivered
            timestamp = str(int(time.time()))
            signed = f"{message.message_id}.{timestamp}.".encode() + message.body
            signature = base64.b64encode(hmac.digest(KEY, signed, hashlib.sha256)).decode()
            headers = {
                "content-type": "application/json",
                "webhook-id": message.message_id or "",
                "webhook-timestamp": timestamp,
                "webhook-signature": "v1," + signature,
            }
            async with session.post(url, data=message.body, headers=headers) as response:
                await response.read()
            await message.ack()
            delivered += 1
            if delivered >= count:
                done.set()

        started, cpu_started_s = time.perf_counter(), time.process_time()
        await consumer_queue.consume(on_message)
        if mode == "live":
            print("ready", flush=True)
        await done.wait()
        elapsed_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started_s
    await queue.delete(if_unused=False, if_empty=False)
    await connection.close()
    print(json.dumps({"deliveries_per_s": count / elapsed_s, "cpu_s": cpu_s}))


if __name__ == "__main__":
    uvloop.run(
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], (sys.argv[5:] or ["backlog"])[0])
    )
