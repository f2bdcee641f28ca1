"""The risky part of issue 24, measured before it is built: what a lane costs the broker against a queue
per endpoint, and how fast a burst can be moved off a lane.

No hookline service runs here: the broker, one publisher and one consumer on this machine, 1 KiB events
published with confirms (500 in flight) while they are consumed, the way `events` routes them:

- ``queues``: a queue per endpoint (quorum), each bound to ``events`` by the tenant's pattern, all of them
  consumed: one event to F endpoints is F queue writes, F deliveries and F acks;
- ``lane``: one lane queue (quorum) bound once for the tenant's pattern, consumed, each message handed
  to F endpoints in the consumer (in process, no HTTP): one write, one delivery, one ack;
- ``handoff``: 10,000 events waiting in a lane, moved by a consumer into a queue of their own (published
  by name with confirms, mandatory, then acked): how long a burst holds the lane;
- ``bindings``: 20,000 tenant-pattern bindings spread over 16 lanes, and their broker memory.

Every routing case also writes the event log stream (bound ``#``), as hookline's topology does.
Reported: events/s and broker CPU (the ``beam.smp`` process's user + system time) per event.

    .venv/bin/python -m bench.lanes                    # every case, three runs each
    .venv/bin/python -m bench.lanes --runs 1 --events 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from bench.run import vhost

QUORUM = {"x-queue-type": "quorum"}
STREAM = {"x-queue-type": "stream", "x-max-length-bytes": 2_000_000_000}
TENANT = "acme"
EVENT_TYPE = "order.created"
IN_FLIGHT = 500
PREFETCH = 200


def broker_pid() -> int:
    done = subprocess.run(["pgrep", "-f", "beam.smp"], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[0])


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def broker_memory_bytes() -> int:
    done = subprocess.run(
        ["rabbitmq-diagnostics", "-q", "memory_breakdown", "--unit", "bytes", "--formatter", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    breakdown = json.loads(done.stdout)
    return int(sum(value for value in breakdown.values() if isinstance(value, int)))


async def topology(
    channel: AbstractChannel, queues: list[str], keys: list[str]
) -> aio_pika.abc.AbstractExchange:
    events = await channel.declare_exchange("events", aio_pika.ExchangeType.TOPIC, durable=True)
    log = await channel.declare_queue("events.log", durable=True, arguments=STREAM)
    await log.bind(events, "#")
    for name in queues:
        queue = await channel.declare_queue(name, durable=True, arguments=QUORUM)
        for key in keys:
            await queue.bind(events, key)
    return events


async def publish_all(exchange: aio_pika.abc.AbstractExchange, count: int, body: bytes) -> None:
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def one(n: int) -> None:
        try:
            await exchange.publish(
                aio_pika.Message(body, message_id=f"evt_{n}", delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                f"{TENANT}.{EVENT_TYPE}",
            )
        finally:
            slots.release()

    tasks = []
    for n in range(count):
        await slots.acquire()
        tasks.append(asyncio.create_task(one(n)))
    await asyncio.gather(*tasks)


async def consume_all(
    channel: AbstractChannel, queues: list[str], expected: int, on_message: Callable[[], Awaitable[None]]
) -> asyncio.Future[None]:
    """Consume ``queues`` until ``expected`` messages were handled; acks batched every 50 (as hookline)."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    seen = 0
    await channel.set_qos(prefetch_count=PREFETCH)

    async def handle(message: AbstractIncomingMessage) -> None:
        nonlocal seen
        await on_message()
        seen += 1
        if seen % 50 == 0 or seen == expected:
            await message.ack(multiple=True)
        if seen >= expected and not done.done():
            done.set_result(None)

    for name in queues:
        queue = await channel.get_queue(name, ensure=False)
        await queue.consume(handle)
    return done


async def route(amqp_url: str, *, shape: str, fanout: int, events: int) -> dict[str, Any]:
    body = json.dumps({"id": "x", "data": "y" * 1000}).encode()
    pid = broker_pid()
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        admin = await connection.channel()
        queues = [f"ep.{n}" for n in range(fanout)] if shape == "queues" else ["lane.0"]
        await topology(admin, queues, [f"{TENANT}.order.*"])
        consumer = await connection.channel()
        fanned = 0

        async def fan_out() -> None:
            nonlocal fanned
            if shape == "lane":
                for _ in range(fanout):  # the parts, in process: what a dispatcher does besides the POSTs
                    fanned += 1
            else:
                fanned += 1

        expected = events * fanout if shape == "queues" else events
        done = await consume_all(consumer, queues, expected, fan_out)
        publisher = await connection.channel(publisher_confirms=True)
        exchange = await publisher.get_exchange("events", ensure=False)
        cpu_before, started = cpu_s(pid), time.perf_counter()
        await publish_all(exchange, events, body)
        await asyncio.wait_for(done, timeout=600)
        elapsed_s, broker_cpu = time.perf_counter() - started, cpu_s(pid) - cpu_before
    return {
        "shape": shape,
        "fanout": fanout,
        "events": events,
        "events_per_s": round(events / elapsed_s),
        "deliveries_per_s": round(fanned / elapsed_s),
        "broker_us_per_event": round(broker_cpu / events * 1e6),
        "broker_us_per_delivery": round(broker_cpu / fanned * 1e6),
    }


async def handoff(amqp_url: str, *, burst: int, in_flight: int) -> dict[str, Any]:
    """A burst waiting in a lane, moved into the endpoint's own queue: consume, publish by name with a
    confirm (mandatory), then ack, ``in_flight`` at once (the lane's prefetch)."""
    body = json.dumps({"id": "x", "data": "y" * 1000}).encode()
    pid = broker_pid()
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        admin = await connection.channel()
        await topology(admin, ["lane.0"], [f"{TENANT}.order.*"])
        await admin.declare_queue("own.0", durable=True, arguments=QUORUM)
        publisher = await connection.channel(publisher_confirms=True)
        await publish_all(await publisher.get_exchange("events", ensure=False), burst, body)
        mover = await connection.channel(publisher_confirms=True, on_return_raises=True)
        consumer = await connection.channel()
        await consumer.set_qos(prefetch_count=in_flight)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        moved = 0

        async def move(message: AbstractIncomingMessage) -> None:
            nonlocal moved
            await mover.default_exchange.publish(
                aio_pika.Message(
                    message.body,
                    message_id=message.message_id,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                "own.0",
                mandatory=True,
            )
            await message.ack()
            moved += 1
            if moved == burst and not done.done():
                done.set_result(None)

        cpu_before, started = cpu_s(pid), time.perf_counter()
        lane = await consumer.get_queue("lane.0", ensure=False)
        await lane.consume(move)
        await asyncio.wait_for(done, timeout=600)
        elapsed_s, broker_cpu = time.perf_counter() - started, cpu_s(pid) - cpu_before
    return {
        "burst": burst,
        "in_flight": in_flight,
        "moved_per_s": round(burst / elapsed_s),
        "seconds": round(elapsed_s, 2),
        "broker_us_per_message": round(broker_cpu / burst * 1e6),
    }


async def bindings(amqp_url: str, *, count: int, lanes: int) -> dict[str, Any]:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        admin = await connection.channel()
        names = [f"lane.{n}" for n in range(lanes)]
        await topology(admin, names, [])
        memory_before = broker_memory_bytes()
        channels = [await connection.channel() for _ in range(8)]
        slots = asyncio.Semaphore(64)
        started = time.perf_counter()

        async def bind(n: int) -> None:
            async with slots:
                queue = await channels[n % len(channels)].get_queue(names[n % lanes], ensure=False)
                await queue.bind("events", f"t{n}.order.*")

        await asyncio.gather(*(bind(n) for n in range(count)))
        elapsed_s = time.perf_counter() - started
        await asyncio.sleep(2)
        memory_after = broker_memory_bytes()
    return {
        "bindings": count,
        "lanes": lanes,
        "created_per_s": round(count / elapsed_s),
        "broker_kib_per_binding": round((memory_after - memory_before) / count / 1024, 2),
    }


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


async def measure(amqp_base_url: str, *, runs: int, events: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    cases = [("queues", 1), ("lane", 1), ("queues", 20), ("lane", 20)]
    for _ in range(runs):  # interleaved, so a slow minute of the machine hits every case alike
        for shape, fanout in cases:
            count = events if fanout == 1 else max(1, events // 4)
            with vhost(amqp_base_url) as url:
                result = await route(url, shape=shape, fanout=fanout, events=count)
            print(json.dumps(result), flush=True)
            report.setdefault(f"{shape}_{fanout}", []).append(result)
        with vhost(amqp_base_url) as url:
            result = await handoff(url, burst=10_000, in_flight=PREFETCH)
        print(json.dumps(result), flush=True)
        report.setdefault("handoff", []).append(result)
    with vhost(amqp_base_url) as url:
        report["bindings"] = await bindings(url, count=20_000, lanes=16)
    print(json.dumps(report["bindings"]), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--amqp-url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--events", type=int, default=20_000)
    arguments = parser.parse_args()
    report = asyncio.run(measure(arguments.amqp_url, runs=arguments.runs, events=arguments.events))
    summary = {
        key: {
            "events_per_s": median_of(rows, "events_per_s"),
            "broker_us_per_event": median_of(rows, "broker_us_per_event"),
        }
        for key, rows in report.items()
        if key not in ("handoff", "bindings")
    }
    summary["handoff"] = {
        "moved_per_s": median_of(report["handoff"], "moved_per_s"),
        "broker_us_per_message": median_of(report["handoff"], "broker_us_per_message"),
    }
    summary["bindings"] = report["bindings"]
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
