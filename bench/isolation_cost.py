"""What isolating many endpoints at once costs the others, measured before it is changed (issue 24,
item 3): with lanes, 100 endpoints turning slow (or their breakers opening) at the same moment get 100
queues of their own at once (in one run, which shared the machine with a test suite, every other
endpoint's events arrived 0.3–0.7 s late meanwhile: was it the broker?).

No hookline service runs here: the broker, a trickle of events published with confirms to a lane queue
(quorum) and the event log stream, consumed at once, and their latency (publish to delivery) measured
while the queues are made:

- ``none``: nothing else (the baseline of the same run);
- ``burst``: 100 quorum queues with an endpoint queue's arguments declared at once, each bound to a
  direct exchange and consumed by two consumers (two dispatchers), as hookline does today;
- ``paced``: the same, at most ``--per-s`` queues a second;
- ``declare-only``: the burst without consumers or bindings (which part costs).

    .venv/bin/python -m bench.isolation_cost
    .venv/bin/python -m bench.isolation_cost --queues 200 --per-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractRobustConnection

from bench.lanes import QUORUM, STREAM
from bench.run import percentile, vhost
from hookline.shared.broker import topology

#: An endpoint's queue of its own as hookline declares it (its dead letters to hookline's exchange).
OWN_QUEUE = topology.endpoint_queue_arguments(single_consumer=False)


async def trickle(
    channel: AbstractChannel, rate_per_s: float, stop: asyncio.Event, sent: dict[str, float]
) -> None:
    exchange = await channel.get_exchange("bench.events")
    while not stop.is_set():
        message_id = uuid.uuid4().hex
        sent[message_id] = time.monotonic()
        await exchange.publish(aio_pika.Message(b"x" * 1024, message_id=message_id), routing_key="acme.a")
        await asyncio.sleep(1 / rate_per_s)


async def make_queues(
    connections: list[AbstractRobustConnection], names: list[str], per_s: float | None, consume: bool
) -> float:
    started = time.monotonic()
    channels = [await connection.channel() for connection in connections]
    delay = await channels[0].declare_exchange("bench.delay", aio_pika.ExchangeType.DIRECT, durable=True)

    async def one(name: str) -> None:
        queue = await channels[0].declare_queue(name, durable=True, arguments=OWN_QUEUE)
        if not consume:
            return
        await queue.bind(delay, routing_key=name)
        for channel in channels:
            own = await channel.get_queue(name, ensure=False)
            await own.consume(lambda message: message.ack(), no_ack=False)

    if per_s is None:
        await asyncio.gather(*(one(name) for name in names))
    else:
        made = []
        for index, name in enumerate(names):
            await asyncio.sleep(max(0.0, started + index / per_s - time.monotonic()))
            made.append(asyncio.get_running_loop().create_task(one(name)))
        await asyncio.gather(*made)
    return time.monotonic() - started


async def case(
    url: str, name: str, queues: int, per_s: float | None, rate_per_s: float, window_s: float
) -> str:
    connections = [await aio_pika.connect_robust(url) for _ in range(3)]
    setup = await connections[0].channel()
    events = await setup.declare_exchange("bench.events", aio_pika.ExchangeType.TOPIC, durable=True)
    await setup.declare_exchange(topology.DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
    lane = await setup.declare_queue("bench.lane", durable=True, arguments=QUORUM)
    await lane.bind(events, "acme.#")
    log = await setup.declare_queue("bench.log", durable=True, arguments=STREAM)
    await log.bind(events, "#")
    await lane.purge()
    sent: dict[str, float] = {}
    latencies_ms: list[float] = []

    async def received(message: AbstractIncomingMessage) -> None:
        at = sent.pop(message.message_id or "", None)
        if at is not None:
            latencies_ms.append((time.monotonic() - at) * 1000)
        await message.ack()

    consumer = await connections[1].channel()
    await consumer.set_qos(prefetch_count=100)
    await (await consumer.get_queue("bench.lane")).consume(received)
    publisher = await connections[2].channel(publisher_confirms=True)
    stop = asyncio.Event()
    task = asyncio.get_running_loop().create_task(trickle(publisher, rate_per_s, stop, sent))
    await asyncio.sleep(2)  # the trickle settled
    latencies_ms.clear()
    names = [f"bench.own.{uuid.uuid4().hex[:8]}" for _ in range(queues)]
    made_s = 0.0
    if name != "none":
        made_s = await make_queues(connections[:2], names, per_s, consume=name != "declare-only")
    await asyncio.sleep(window_s)
    stop.set()
    await task
    for connection in connections:  # the consumers first: a queue deleted under one cancels it
        await connection.close()
    async with await aio_pika.connect_robust(url) as cleanup:
        channel = await cleanup.channel()
        for queue_name in names:
            await channel.queue_delete(queue_name)
    return (
        f"{name:>13}: {len(latencies_ms)} events, p50 {statistics.median(latencies_ms):.1f} ms, "
        f"p99 {percentile(latencies_ms, 0.99):.1f} ms, max {max(latencies_ms):.1f} ms"
        + (f"; {queues} queues in {made_s:.2f} s" if name != "none" else "")
    )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--amqp-url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--queues", type=int, default=100)
    parser.add_argument("--per-s", type=float, default=10.0)
    parser.add_argument("--rate-per-s", type=float, default=20.0)
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--cases", default="none,burst,paced,declare-only")
    args = parser.parse_args()
    with vhost(args.amqp_url) as url:
        for run in range(args.runs):
            for name in args.cases.split(","):
                per_s = args.per_s if name == "paced" else None
                print(
                    f"run {run + 1}",
                    await case(url, name, args.queues, per_s, args.rate_per_s, args.window_s),
                )


if __name__ == "__main__":
    asyncio.run(main())
