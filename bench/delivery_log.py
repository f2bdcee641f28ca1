"""How fast the ingest's delivery log answers with a week of history, and how much disk it takes.

A delivery log (the ingest's SQLite views) is filled through the same code the stream followers use
(``RowView.apply`` on telemetry batches and event log records) with N attempts for N / 3 events over
1,000 endpoints, then each question is asked many times: an event's attempts (``GET /v1/events/{id}``),
an endpoint's latest attempts (``GET /v1/endpoints/{id}/attempts``, first and a deep page), the recent
events of a tenant, and the retention pass. Reported: p50 / p99 milliseconds per query, the fill rate,
and the files' size.

    .venv/bin/python -m bench.delivery_log --attempts 1000000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import uvloop

from hookline.ingest.deliverylog import DeliveryLog
from hookline.shared.contracts.headers import Header
from hookline.shared.contracts.telemetry import AttemptRecord, batch

ENDPOINTS = 1000
TENANTS = 50
BATCH = 500


@dataclass
class Record:
    """A stream record as the views read it."""

    body: bytes
    headers: Mapping[str, Any] = field(default_factory=dict)
    message_id: str | None = None
    timestamp: datetime | None = None
    routing_key: str | None = None
    user_id: str | None = None


async def fill(log: DeliveryLog, attempts: int, now_s: float) -> float:
    rng = random.Random(7)
    started = time.perf_counter()
    events = attempts // 3
    span_s = 6 * 86400.0
    for n in range(events):
        tenant = f"t{n % TENANTS}"
        event = {
            "id": f"evt_{n:026d}",
            "tenant": tenant,
            "type": f"type.{n % 40}",
            "subject": f"s{n % 997}",
            "data": {},
        }
        at_ms = int((now_s - span_s + span_s * n / events) * 1000)
        headers = {"x-stream-offset": n, Header.ACCEPTED_AT_MS: at_ms}
        log.events.apply(
            Record(orjson.dumps(event), headers, routing_key=f"{event['tenant']}.{event['type']}")
        )
        if log.events.pending >= 20_000:
            await log.events.flush()
    await log.events.flush()
    records: list[AttemptRecord] = []
    offset = 0
    for n in range(attempts):
        event_n = n // 3
        at_s = now_s - span_s + span_s * event_n / events
        records.append(
            AttemptRecord(
                at_s=at_s,
                dispatcher_id="bench:1",
                event_id=f"evt_{event_n:026d}",
                endpoint_id=f"ep_{(event_n * 7 + n % 3) % ENDPOINTS:026d}",
                tenant=f"t{event_n % TENANTS}",
                type=f"type.{event_n % 40}",
                attempt=n % 3 + 1,
                outcome="success" if n % 3 == 2 else "retry",
                status=200 if n % 3 == 2 else 503,
                error=None,
                duration_ms=rng.uniform(2, 200),
                first_attempt_at_s=at_s,
                attempt_kind="delivery" if n % 3 == 0 else "retry",
                response_headers={"content-type": "text/plain"},
                response_body="ok" * 20,
            )
        )
        if len(records) == BATCH:
            log.attempts.apply(Record(batch.dump_json(records), {"x-stream-offset": offset}))
            offset += 1
            records = []
            if log.attempts.pending >= 20_000:
                await log.attempts.flush()
    await log.attempts.flush()
    return time.perf_counter() - started


async def timed(query: Callable[[int], Awaitable[object]], runs: int) -> dict[str, float]:
    samples = []
    for n in range(runs):
        started = time.perf_counter()
        await query(n)
        samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return {
        "p50_ms": round(statistics.median(samples), 2),
        "p99_ms": round(samples[int(len(samples) * 0.99) - 1], 2),
    }


async def main(attempts: int, runs: int) -> dict[str, Any]:
    now_s = time.time()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "ingest-8000.sqlite"
        async with DeliveryLog(path, vhost="bench", retention_s=7 * 86400) as log:
            fill_s = await fill(log, attempts, now_s)
            events = attempts // 3
            rng = random.Random(11)
            results = {
                "event_attempts": await timed(
                    lambda _: log.attempts_of_event(f"evt_{rng.randrange(events):026d}"), runs
                ),
                "event_lookup": await timed(lambda _: log.event(f"evt_{rng.randrange(events):026d}"), runs),
                "endpoint_attempts_first_page": await timed(
                    lambda _: log.attempts_of_endpoint(
                        f"ep_{rng.randrange(ENDPOINTS):026d}",
                        outcome=None,
                        since_s=None,
                        before_id=None,
                        limit=100,
                    ),
                    runs,
                ),
                "endpoint_attempts_failures_page": await timed(
                    lambda _: log.attempts_of_endpoint(
                        f"ep_{rng.randrange(ENDPOINTS):026d}",
                        outcome="retry",
                        since_s=None,
                        before_id=(attempts // BATCH // 2) * 1024,
                        limit=100,
                    ),
                    runs,
                ),
                "tenant_recent_events": await timed(
                    lambda _: log.recent_events(
                        tenant=f"t{rng.randrange(TENANTS)}",
                        type=None,
                        subject=None,
                        since_s=None,
                        until_s=None,
                        before_offset=None,
                        limit=50,
                    ),
                    runs,
                ),
            }
            started = time.perf_counter()
            removed = await log.expire(now_s=now_s + 2 * 86400)  # two days on: the oldest of six days goes
            results["expire_one_day"] = {
                "ms": round((time.perf_counter() - started) * 1000, 1),
                "rows": removed,
            }
        size_mb = _size_mb(Path(directory))
    return {
        "attempts": attempts,
        "events": attempts // 3,
        "fill_s": round(fill_s, 1),
        "fill_attempts_per_s": round(attempts / fill_s),
        "disk_mb": round(size_mb, 1),
        "queries": results,
    }


def _size_mb(directory: Path) -> float:
    return sum(f.stat().st_size for f in directory.iterdir()) / 1e6


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attempts", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    print("DELIVERY_LOG", json.dumps(uvloop.run(main(args.attempts, args.runs))))


if __name__ == "__main__":
    cli()
