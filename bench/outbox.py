"""The outbox relay beside the direct publish path: the same number of events into ``events``, in one run.

- direct: an upstream publishing over AMQP with publisher confirms, 500 in flight (what the relay does
  inside each batch), events/s;
- outbox, live: rows committed in transactions of 100 by one writer while 1, then 2, relays run: rows/s
  from the first commit to the last row routed, and each row's lag (``created_at`` in the business
  transaction → routed to ``events``, seen by a queue of the bench's own): p50 / p99;
- outbox, backlog: the rows committed first, then one relay started: rows/s from its first publish.

Needs the PostgreSQL at ``--postgres-url`` (a user that may create databases) and RabbitMQ.

    .venv/bin/python -m bench.outbox --rows 10000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import psycopg
import uvloop

from bench.run import free_port, percentile, vhost, wait_ready

HOOKLINE = str(Path(sys.executable).with_name("hookline"))
TENANT = "bench"
TRANSACTION_ROWS = 100
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


@contextlib.contextmanager
def database(server_url: str) -> Iterator[str]:
    name = f"hookline_bench_outbox_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
        try:
            yield urlunsplit(urlsplit(server_url)._replace(path=f"/{name}"))
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')  # type: ignore[arg-type]


@dataclass
class Tap:
    """When each event was routed to ``events`` (seen by an exclusive queue bound to it), and the
    time its publisher says it was accepted (the row's created_at, for the relay)."""

    arrived_s: dict[str, float] = field(default_factory=dict)
    accepted_s: dict[str, float] = field(default_factory=dict)
    more: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait(self, ids: set[str], timeout_s: float = 600) -> None:
        async with asyncio.timeout(timeout_s):
            while not ids <= self.arrived_s.keys():
                self.more.clear()
                await self.more.wait()


@contextlib.asynccontextmanager
async def tapped(amqp_url: str) -> AsyncIterator[Tap]:
    tap = Tap()
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=2000)
        events = await channel.declare_exchange("events", aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(events, routing_key="#")

        async def seen(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            now_s = time.time()
            event_id = message.message_id or ""
            tap.arrived_s.setdefault(event_id, now_s)
            accepted_ms = (message.headers or {}).get("x-hookline-accepted-at-ms")
            if isinstance(accepted_ms, int):
                tap.accepted_s.setdefault(event_id, accepted_ms / 1000)
            tap.more.set()
            await message.ack()

        await queue.consume(seen)
        yield tap


def body(event_id: str, n: int) -> bytes:
    return json.dumps({
        "id": event_id, "type": "order.created", "tenant": TENANT, "occurred_at": "2026-12-01T10:00:00Z",
        "subject": f"order_{n % 100}", "data": {"order_id": n, "total": 4200},
    }).encode()  # fmt: skip


async def direct(amqp_url: str, tap: Tap, rows: int) -> dict[str, Any]:
    """An upstream's own publisher: confirms, a window of 500 in flight."""
    ids = [f"evt_direct_{uuid.uuid4().hex[:8]}_{n}" for n in range(rows)]
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        events = await channel.get_exchange("events", ensure=False)
        started_s = time.time()
        for first in range(0, rows, 500):
            await asyncio.gather(*(
                events.publish(
                    aio_pika.Message(
                        body(event_id, first + n), message_id=event_id, content_type="application/json",
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                        headers={"x-hookline-accepted-at-ms": int(time.time() * 1000)},
                    ),
                    routing_key=f"{TENANT}.order.created",
                )
                for n, event_id in enumerate(ids[first : first + 500])
            ))  # fmt: skip
        confirmed_s = time.time()
    await tap.wait(set(ids))
    return {
        "mode": "direct publish",
        "rows": rows,
        "per_s": rows / (confirmed_s - started_s),
        **lags(tap, ids),
    }


def lags(tap: Tap, ids: list[str]) -> dict[str, float]:
    lag_ms = [(tap.arrived_s[i] - tap.accepted_s[i]) * 1000 for i in ids if i in tap.accepted_s]
    return {"lag_p50_ms": percentile(lag_ms, 0.5), "lag_p99_ms": percentile(lag_ms, 0.99)}


def insert(dsn: str, rows: int, prefix: str) -> list[str]:
    """Rows committed in transactions of TRANSACTION_ROWS, each row one INSERT (as a business
    transaction writes it); their ids."""
    ids: list[str] = []
    with psycopg.connect(dsn) as conn:
        for first in range(0, rows, TRANSACTION_ROWS):
            with conn.transaction():
                for n in range(first, min(rows, first + TRANSACTION_ROWS)):
                    event_id = f"evt_{prefix}_{n}"
                    conn.execute(
                        "INSERT INTO hookline_outbox (id, tenant, type, subject, numbered, data) "
                        "VALUES (%s, %s, 'order.created', %s, true, %s)",
                        (event_id, TENANT, f"order_{n % 100}", json.dumps({"order_id": n, "total": 4200})),
                    )
                    ids.append(event_id)
    return ids


@contextlib.contextmanager
def relays(amqp_url: str, dsn: str, count: int, work: Path) -> Iterator[None]:
    processes = []
    for n in range(count):
        port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("HOOKLINE_")},
            "HOOKLINE_AMQP_URL": amqp_url, "HOOKLINE_OUTBOX_DSN": dsn, "HOOKLINE_OUTBOX_METRICS_PORT": str(port),
            "HOOKLINE_LOG_LEVEL": "warning",
        }  # fmt: skip
        log = (work / f"outbox-relay-{n}.log").open("wb")
        process = subprocess.Popen([HOOKLINE, "outbox-relay"], env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_ready(port, process)
        processes.append(process)
    try:
        yield
    finally:
        for process in processes:
            process.terminate()
            process.wait(30)


async def outbox_live(amqp_url: str, dsn: str, tap: Tap, rows: int, count: int, work: Path) -> dict[str, Any]:
    with relays(amqp_url, dsn, count, work):
        started_s = time.time()
        ids = await asyncio.to_thread(insert, dsn, rows, f"live{count}_{uuid.uuid4().hex[:6]}")
        committed_s = time.time()
        await tap.wait(set(ids))
    done_s = max(tap.arrived_s[i] for i in ids)
    return {
        "mode": f"outbox, {count} relay{'s' if count > 1 else ''}, rows committed meanwhile",
        "rows": rows,
        "per_s": rows / (done_s - started_s),
        "writer_per_s": rows / (committed_s - started_s),
        **lags(tap, ids),
    }


async def outbox_backlog(amqp_url: str, dsn: str, tap: Tap, rows: int, work: Path) -> dict[str, Any]:
    ids = await asyncio.to_thread(insert, dsn, rows, f"backlog_{uuid.uuid4().hex[:6]}")
    with relays(amqp_url, dsn, 1, work):
        await tap.wait(set(ids))
    first_s = min(tap.arrived_s[i] for i in ids)
    last_s = max(tap.arrived_s[i] for i in ids)
    return {"mode": "outbox, 1 relay, a backlog", "rows": rows, "per_s": rows / (last_s - first_s)}


async def measure(amqp_url: str, postgres_url: str, rows: int, work: Path) -> dict[str, Any]:
    with database(postgres_url) as dsn:
        migrated = await asyncio.to_thread(
            subprocess.run,
            [HOOKLINE, "outbox-relay", "--dsn", dsn, "--migrate"],
            capture_output=True,
            text=True,
            check=False,
        )
        if migrated.returncode != 0:
            raise RuntimeError(migrated.stderr)
        async with tapped(amqp_url) as tap:
            results = [await direct(amqp_url, tap, rows)]
            for count in (1, 2):
                results.append(await outbox_live(amqp_url, dsn, tap, rows, count, work))
            results.append(await outbox_backlog(amqp_url, dsn, tap, rows, work))
    direct_rate = results[0]["per_s"]
    for row in results:
        row["vs_direct"] = row["per_s"] / direct_rate
    return {"rows": rows, "results": results}


def markdown(report: dict[str, Any]) -> list[str]:
    lines = []
    for row in report["results"]:
        lag = (
            f"; lag p50 {row['lag_p50_ms']:.0f} ms, p99 {row['lag_p99_ms']:.0f} ms"
            if "lag_p50_ms" in row
            else ""
        )
        lines.append(
            f"| {row['mode']}, {row['rows']:,} events | {row['per_s']:,.0f}/s{lag} | {row['vs_direct']:.2f} of direct |"
        )
    return lines


async def main(arguments: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="hookline-bench-outbox-"))
    with vhost(arguments.amqp_url) as amqp_url:
        return await measure(amqp_url, arguments.postgres_url, arguments.rows, work)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--amqp-url", default=os.environ.get("HOOKLINE_AMQP_URL", "amqp://guest:guest@localhost:5672/")
    )
    parser.add_argument(
        "--postgres-url", default=os.environ.get("HOOKLINE_BENCH_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    )
    parser.add_argument("--rows", type=int, default=10_000)
    report = uvloop.run(main(parser.parse_args()))
    print(json.dumps(report, indent=2))
    print("\n".join(markdown(report)))
