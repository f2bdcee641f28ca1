"""A polling endpoint fetching a backlog (issue 25, item 5): N events published to its tenant, then fetched
page by page with its poll_token, as a customer's job would. Reported: events fetched per second, the
time per poll (p50, p99), the ingest's CPU per 1,000 events fetched, and its RSS after. The ingest alone
serves polls (no dispatcher is needed: nothing is pushed), so its numbers are the whole cost.

    .venv/bin/python -m bench.polling --events 10000 --limit 250

``--other-types K`` publishes K events of another type of the same tenant between each of the
endpoint's: what a poll scans past without returning (each poll looks through at most 2,000 rows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.endpoint_scale import cpu_s
from bench.run import TENANT, Services, events_exchange, message, percentile, rss_mib, vhost


async def publish(amqp_url: str, count: int, other_types: int) -> None:
    """``count`` events of type load.e0, and ``other_types`` of load.e1 after each (confirmed)."""
    async with events_exchange(amqp_url) as exchange:
        pending = []
        for n in range(count):
            pending.append(exchange.publish(message(f"poll{n}", 0), f"{TENANT}.load.e0"))
            for k in range(other_types):
                pending.append(exchange.publish(message(f"other{n}_{k}", 1), f"{TENANT}.load.e1"))
            if len(pending) >= 500:
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)


async def run(amqp_url: str, *, count: int, limit: int, other_types: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="hookline-polling-"))
    services = Services(amqp_url, work)
    try:
        services.start_ingest()
        ingest = services.processes[0]
        async with services.api() as api:
            created = await api.post(
                "/v1/endpoints", json={"tenant": TENANT, "kind": "polling", "event_types": ["load.e0"]}
            )
            created.raise_for_status()
            endpoint = created.json()
        await publish(amqp_url, count, other_types)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{services.ingest_port}",
            headers={"authorization": f"Bearer {endpoint['poll_token']}"},
            timeout=60,
        ) as poller:
            # The ingest's delivery log follows the event log: wait until it has the last event.
            deadline = time.monotonic() + 120
            while True:
                page = (await poller.get(f"/v1/endpoints/{endpoint['id']}/poll", params={"limit": 1})).json()
                if page["data"]:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("no event reached the delivery log")
                await asyncio.sleep(0.2)
            await asyncio.sleep(2)  # the rest of the backlog indexed too (the delivery log trails by less)
            fetched: list[str] = []
            poll_ms: list[float] = []
            iterator: str | None = None
            cpu_before = cpu_s(ingest.pid)
            started = time.perf_counter()
            while len(fetched) < count:
                params: dict[str, Any] = {"limit": limit}
                if iterator:
                    params["iterator"] = iterator
                polled_at = time.perf_counter()
                response = await poller.get(f"/v1/endpoints/{endpoint['id']}/poll", params=params)
                poll_ms.append((time.perf_counter() - polled_at) * 1000)
                response.raise_for_status()
                page = response.json()
                fetched += [event["id"] for event in page["data"]]
                iterator = page["next_iterator"]
                if page["done"] and not page["data"] and len(fetched) < count:
                    await asyncio.sleep(0.2)  # indexed still
            elapsed_s = time.perf_counter() - started
            cpu_used_s = cpu_s(ingest.pid) - cpu_before
    finally:
        rss = rss_mib(services.processes[0]) if services.processes else None
        services.stop_all()
    assert fetched == [f"poll{n}" for n in range(count)], "fetched out of order, twice or not at all"
    return {
        "events": count,
        "other_types_between": other_types,
        "limit": limit,
        "fetched_per_s": round(count / elapsed_s),
        "polls": len(poll_ms),
        "poll_p50_ms": round(percentile(poll_ms, 0.5), 1),
        "poll_p99_ms": round(percentile(poll_ms, 0.99), 1),
        "ingest_cpu_ms_per_1000": round(cpu_used_s / count * 1_000_000),
        "ingest_rss_mib": round(rss, 1) if rss is not None else None,
    }


def markdown(result: dict[str, Any]) -> list[str]:
    """make bench's row for a result of :func:`run`."""
    return [
        f"| a polling endpoint fetching a backlog of {result['events']:,} events, {result['limit']} a poll | "
        f"{result['fetched_per_s']:,}/s, a poll p50 {result['poll_p50_ms']:.0f} ms, p99 "
        f"{result['poll_p99_ms']:.0f} ms; the ingest {result['ingest_cpu_ms_per_1000']:,} ms of CPU per 1,000 "
        f"fetched, {result['ingest_rss_mib']} MiB | |"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--amqp-url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--limit", type=int, default=250)
    parser.add_argument("--other-types", type=int, default=0)
    arguments = parser.parse_args()
    with vhost(arguments.amqp_url) as amqp_url:
        result = asyncio.run(
            run(amqp_url, count=arguments.events, limit=arguments.limit, other_types=arguments.other_types)
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
