"""The health monitor's memory under sustained load: its RSS over time, and the slope over the second half.

A monitor runs against a vhost of its own with 50 endpoints registered (their queues provisioned), and
is fed telemetry as two dispatchers send it: RATE events/s, one first attempt each, spread over the 50
endpoints and 2,000 event types (uniformly: every type's statistics fill up), 5 endpoints always
failing (503) with their events retried on hookline's default schedule (30 s, 2 min, 10 min, 30 min,
2 h, 6 h), each dispatcher's heartbeat every 5 s; batches every 250 ms, confirmed. The monitor's RSS
is read every 10 s. Reported: the curve (a point a minute), the peak, and the least-squares slope over
the second half, against the targets (under 200 MiB; under 1 MiB/min over the second half of an hour).

``make bench`` runs it for 6 minutes (what the bench affords); the hour:

    .venv/bin/python -m bench.monitor_soak --duration-s 3600
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import uvloop

from bench.run import HOOKLINE, TOKEN, free_port, rss_mib, vhost, wait_ready
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.contracts.models import SigningSecret, StoredEndpoint
from hookline.shared.contracts.telemetry import AttemptRecord, Heartbeat, Outcome, batch
from hookline.shared.outbound.signing import generate_secret
from hookline.shared.runtime.supervision import Supervisor
from hookline.shared.state import registry

ENDPOINTS = 50
TYPES = 2_000
FAILING = 5
RETRY_SCHEDULE_S = (30, 120, 600, 1800, 7200, 21600)
TICK_S = 0.25
SAMPLE_S = 10.0
DISPATCHERS = ("bench-d1", "bench-d2")
HEARTBEAT_S = 5.0
TARGET_MAX_MIB = 200.0
TARGET_SLOPE_MIB_PER_MIN = 1.0


def endpoint_id(n: int) -> str:
    return f"ep_{n:026d}"


async def register(amqp_url: str) -> None:
    """The endpoints in the change log and their queues, as the ingest would leave them."""
    now = datetime.now(UTC)
    supervisor = Supervisor()
    async with Broker(amqp_url, name="bench-soak-setup", connect_timeout_s=30) as broker:
        await topology.declare(broker, topology.Retention())
        publisher = Publisher(broker)
        try:
            change_log = await registry.follow(
                broker, publisher, supervisor, registry.EndpointRegistry(), sync_timeout_s=30
            )
            for n in range(ENDPOINTS):
                endpoint = StoredEndpoint(
                    id=endpoint_id(n), tenant="bench", url=f"https://bench.example/{n}", event_types=["#"],
                    created_at=now, updated_at=now, routed=True, laned=True,
                    secrets=[SigningSecret(value=generate_secret(), created_at=now)],
                )  # fmt: skip
                async with broker.channel() as channel:
                    await topology.provision(channel, endpoint, isolated=False)
                await change_log.upsert(endpoint, base_version=0, timeout_s=30)
        finally:
            await supervisor.stop()
            await publisher.close()


@dataclass
class Load:
    """What two dispatchers would report: first attempts at ``rate``/s, the failing ones' retries."""

    rate: float
    rng: random.Random = field(default_factory=lambda: random.Random(23))
    sent: int = 0
    records: int = 0
    _owed: float = 0.0
    _retries: list[tuple[float, int, int, str, int, float]] = field(default_factory=list)
    _beat_at_s: float = 0.0

    def tick(self, now_s: float) -> list[AttemptRecord | Heartbeat]:
        self._owed += self.rate * TICK_S
        records: list[AttemptRecord | Heartbeat] = []
        while self._owed >= 1:
            self._owed -= 1
            self.sent += 1
            n = self.sent
            endpoint = n % ENDPOINTS
            event_type = f"load.t{self.rng.randrange(TYPES)}"
            records.append(self._attempt(now_s, n, endpoint, event_type, 1, now_s))
        while self._retries and self._retries[0][0] <= now_s:
            _, n, endpoint, event_type, attempt, first_s = heapq.heappop(self._retries)
            records.append(self._attempt(now_s, n, endpoint, event_type, attempt, first_s))
        if now_s - self._beat_at_s >= HEARTBEAT_S:
            self._beat_at_s = now_s
            records += [
                Heartbeat(at_s=now_s, dispatcher_id=d, in_flight=8, consumers=ENDPOINTS) for d in DISPATCHERS
            ]
        self.records += len(records)
        return records

    def _attempt(
        self, now_s: float, n: int, endpoint: int, event_type: str, attempt: int, first_s: float
    ) -> AttemptRecord:
        failing = endpoint < FAILING
        next_s = None
        if failing:
            next_s = now_s + RETRY_SCHEDULE_S[min(attempt - 1, len(RETRY_SCHEDULE_S) - 1)]
            heapq.heappush(self._retries, (next_s, n, endpoint, event_type, attempt + 1, first_s))
        return AttemptRecord(
            at_s=now_s, dispatcher_id=DISPATCHERS[n % 2], event_id=f"evt_{n:026d}", endpoint_id=endpoint_id(endpoint),
            tenant="bench", type=event_type, attempt=attempt,
            outcome=Outcome.RETRY if failing else Outcome.SUCCESS, status=503 if failing else 204, error=None,
            duration_ms=self.rng.lognormvariate(4.5 if failing else 3.0, 0.8), connect_ms=1.0,
            first_attempt_at_s=first_s, next_attempt_at_s=next_s,
            attempt_kind="delivery" if attempt == 1 else "retry",
        )  # fmt: skip


async def feed(amqp_url: str, load: Load, until_s: float) -> None:
    """Telemetry batches every TICK_S until ``until_s`` (monotonic), each publish confirmed."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(topology.TELEMETRY_EXCHANGE, ensure=False)
        next_s = time.monotonic()
        while next_s < until_s:
            records = load.tick(time.time())
            if records:
                body = batch.dump_json(records)  # type: ignore[arg-type]
                await exchange.publish(aio_pika.Message(body, content_type="application/json"), "")
            next_s += TICK_S
            await asyncio.sleep(max(0.0, next_s - time.monotonic()))


def start_monitor(amqp_url: str, work: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLINE_")}
    env.update(
        HOOKLINE_AMQP_URL=amqp_url,
        HOOKLINE_API_TOKEN=TOKEN,
        HOOKLINE_MONITOR_PORT=str(port),
        HOOKLINE_STATE_DIR=str(work / "soak-state"),
        HOOKLINE_CONNECT_TIMEOUT_S="60",
    )
    process = subprocess.Popen(
        [HOOKLINE, "health-monitor"],
        env=env,
        stdout=(work / "monitor-soak.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    wait_ready(port, process, timeout_s=120)
    return process, port


def slope_mib_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    if len(points) < 2:
        return 0.0
    return statistics.linear_regression([t for t, _ in points], [m for _, m in points]).slope * 60


async def sample(
    process: subprocess.Popen[bytes], until_s: float, started_s: float
) -> list[tuple[float, float]]:
    points: list[tuple[float, float]] = []
    while time.monotonic() < until_s:
        points.append((time.monotonic() - started_s, rss_mib(process)))
        await asyncio.sleep(SAMPLE_S)
    points.append((time.monotonic() - started_s, rss_mib(process)))
    return points


async def measure(amqp_url: str, work: Path, *, duration_s: float, rate: float) -> dict[str, Any]:
    await register(amqp_url)
    process, port = start_monitor(amqp_url, work)
    try:
        load = Load(rate)
        started_s = time.monotonic()
        until_s = started_s + duration_s
        points, _ = await asyncio.gather(sample(process, until_s, started_s), feed(amqp_url, load, until_s))
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"authorization": f"Bearer {TOKEN}"}, timeout=60
        ) as http:
            status = (await http.get("/v1/status")).json()
            types = (await http.get("/v1/types/health")).json()
    finally:
        process.terminate()
        process.wait(60)
    second_half = [(t, m) for t, m in points if t >= duration_s / 2]
    result = {
        "duration_s": duration_s,
        "rate_per_s": rate,
        "endpoints": ENDPOINTS,
        "event_types": TYPES,
        "failing_endpoints": FAILING,
        "records_published": load.records,
        "monitor_types_listed": len(types),
        "monitor_attempts_last_hour": status["delivered_last_hour"] + status["failed_last_hour"],
        "rss_start_mib": round(points[0][1], 1),
        "rss_max_mib": round(max(m for _, m in points), 1),
        "rss_end_mib": round(points[-1][1], 1),
        "slope_second_half_mib_per_min": round(slope_mib_per_min(second_half), 3),
        # A point a minute (seconds since the load started, MiB).
        "curve": [
            (round(t), round(m, 1)) for t, m in points if round(t) % 60 < SAMPLE_S or (t, m) == points[-1]
        ],
    }
    result["within_targets"] = (
        result["rss_max_mib"] < TARGET_MAX_MIB
        and result["slope_second_half_mib_per_min"] < TARGET_SLOPE_MIB_PER_MIN
    )
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    curve = ", ".join(f"{t // 60:.0f} min {m:.0f}" for t, m in result["curve"])
    return [
        f"| health monitor soak: {result['duration_s'] / 60:.0f} min at {result['rate_per_s']:.0f} events/s, "
        f"{result['endpoints']} endpoints ({result['failing_endpoints']} failing), {result['event_types']:,} types "
        f"| RSS {result['rss_start_mib']:.0f} → {result['rss_end_mib']:.0f} MiB (peak {result['rss_max_mib']:.0f}), "
        f"{result['slope_second_half_mib_per_min']:+.2f} MiB/min over the second half "
        f"(targets < {TARGET_MAX_MIB:.0f} MiB, < {TARGET_SLOPE_MIB_PER_MIN:.0f} MiB/min); MiB by minute: {curve} | |"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--amqp-url", default=os.environ.get("HOOKLINE_AMQP_URL", "amqp://guest:guest@localhost:5672/")
    )
    parser.add_argument("--duration-s", type=float, default=360.0)
    parser.add_argument("--rate", type=float, default=300.0, help="events per second")
    parser.add_argument("--out", type=Path, help="also write the result (JSON) here")
    arguments = parser.parse_args()
    with vhost(arguments.amqp_url) as amqp_url:
        work = Path(tempfile.mkdtemp(prefix="hookline-bench-soak-"))
        print(f"logs in {work}", flush=True)
        result = uvloop.run(measure(amqp_url, work, duration_s=arguments.duration_s, rate=arguments.rate))
    text = json.dumps(result, indent=2)
    if arguments.out:
        arguments.out.write_text(text)
    print(text)
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
