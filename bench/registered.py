"""Registered endpoints that cost the broker nothing (issue 24, item 1): a SaaS operator's T tenants
with E endpoints each, registered through the ingest's API as a user would (32 at a time, no handshake),
on this machine's broker as configured (no raised file-handle limit); then one event per tenant, which
must reach every one of its endpoints.

Reported: the registration rate (overall, and over the last tenth), broker memory per registered
endpoint (``rabbitmq-diagnostics memory_breakdown`` before and after) and its queue count and file
handles, each dispatcher's RSS, the seconds from the first publish until every endpoint had its event,
and whether every endpoint got exactly its own tenant's event.

    .venv/bin/python -m bench.registered --tenants 1000 --per-tenant 20      # issue 24, item 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aio_pika

from bench.endpoint_scale import rss_mib
from bench.run import Services, events_exchange, start_sink, vhost
from bench.slow_endpoints import wait_for

CONCURRENCY = 32
EVENT_TYPE = "order.created"


def broker_status() -> dict[str, Any]:
    done = subprocess.run(
        ["rabbitmq-diagnostics", "-q", "status", "--formatter", "json"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    status = json.loads(done.stdout)
    return {
        "memory_bytes": int(status["memory"]["total"]["rss"]),
        "file_descriptors_used": status["file_descriptors"]["total_used"],
        "file_descriptors_limit": status["file_descriptors"]["total_limit"],
    }


def queue_count(vhost_name: str) -> int:
    done = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "-p", vhost_name, "name"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return len([line for line in done.stdout.splitlines() if line.strip()])


async def register(services: Services, tenants: int, per_tenant: int, sink_port: int) -> list[float]:
    """Every endpoint, CONCURRENCY at a time; when each registration was answered."""
    answered: list[float] = []
    pending = [(t, n) for t in range(tenants) for n in range(per_tenant)]
    async with services.api() as api:

        async def worker() -> None:
            while pending:
                t, n = pending.pop(0)
                response = await api.post(
                    "/v1/endpoints",
                    json={
                        "tenant": f"t{t:05d}", "url": f"http://127.0.0.1:{sink_port}/t{t}/e{n}",
                        "event_types": ["order.*"], "verify": False,
                    },
                )  # fmt: skip
                response.raise_for_status()
                answered.append(time.perf_counter())

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return answered


async def publish_one_each(amqp_url: str, tenants: int, *, digits: int = 5) -> None:
    async with events_exchange(amqp_url) as exchange:
        for t in range(tenants):
            tenant = f"t{t:0{digits}d}"
            event_id = f"evt_{tenant}"
            body = json.dumps(
                {"id": event_id, "type": EVENT_TYPE, "tenant": tenant, "occurred_at": "2026-12-02T00:00:00Z",
                 "data": {"n": t}}
            ).encode()  # fmt: skip
            await exchange.publish(
                aio_pika.Message(
                    body, content_type="application/json", message_id=event_id,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                f"{tenant}.{EVENT_TYPE}",
            )  # fmt: skip


async def run(amqp_url: str, *, tenants: int, per_tenant: int, wait_s: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="hookline-registered-"))
    sink = start_sink(work)
    services = Services(amqp_url, work)
    expected = tenants * per_tenant
    try:
        services.start_ingest()
        services.start_monitor()
        services.start_dispatchers(2)
        dispatchers = list(services.dispatchers)
        before = broker_status()
        started = time.perf_counter()
        answered = await register(services, tenants, per_tenant, sink.port)
        register_s = time.perf_counter() - started
        answered.sort()
        tenth = answered[-max(1, len(answered) // 10) :]
        last_tenth_per_s = (len(tenth) - 1) / (tenth[-1] - tenth[0]) if len(tenth) > 1 else None
        await asyncio.sleep(5)  # the broker settles (its write-ahead log), the monitor polls
        after = broker_status()
        queues = queue_count(amqp_url.rsplit("/", 1)[1])
        rss = [round(rss_mib(process.pid), 1) for process in dispatchers]
        published = time.perf_counter()
        await publish_one_each(amqp_url, tenants)
        await wait_for(sink.count, expected, time.monotonic() + wait_s)
        delivered_s = time.perf_counter() - published
        rss_after = [round(rss_mib(process.pid), 1) for process in dispatchers]
    finally:
        services.stop_all()
        arrivals = sink.finish()["arrivals"]
    right = sum(
        1
        for key in arrivals
        if (parts := key.split(" ")) and parts[1] == f"evt_t{int(parts[0].split('/')[1][1:]):05d}"
    )
    return {
        "tenants": tenants,
        "endpoints": expected,
        "registered_per_s": round(expected / register_s, 1),
        "registered_per_s_last_tenth": round(last_tenth_per_s, 1) if last_tenth_per_s else None,
        "broker_memory_per_endpoint_kib": round((after["memory_bytes"] - before["memory_bytes"]) / expected / 1024, 2),
        "broker_memory_mib": [round(before["memory_bytes"] / 2**20), round(after["memory_bytes"] / 2**20)],
        "broker_file_descriptors": [before["file_descriptors_used"], after["file_descriptors_used"], after["file_descriptors_limit"]],
        "queues_in_the_vhost": queues,
        "dispatcher_rss_mib": rss,
        "dispatcher_rss_after_delivery_mib": rss_after,
        "delivered": len(arrivals),
        "delivered_its_own_tenants_event": right,
        "all_delivered_s": round(delivered_s, 1) if len(arrivals) >= expected else None,
        "logs": str(work),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--amqp-url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--per-tenant", type=int, default=20)
    parser.add_argument("--wait-s", type=float, default=300.0)
    arguments = parser.parse_args()
    with vhost(arguments.amqp_url) as amqp_url:
        result = asyncio.run(
            run(amqp_url, tenants=arguments.tenants, per_tenant=arguments.per_tenant, wait_s=arguments.wait_s)
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
