"""Isolation when many endpoints are slow at once: S endpoints that answer after a delay and H healthy
ones, all of one tenant and subscribed to the same E events, served by D dispatchers with their default
settings (the retry schedule, the breaker threshold and the attempt timeout included) and a monitor.

Reported for the healthy endpoints: deliveries (distinct endpoint and event), the seconds from the first
publish until all arrived, latency publish → arrival (p50, p99, max), attempts that were not a success
(the dispatchers' own log lines: a timeout there is an isolation failure), retries scheduled and the
breakers that changed (the monitor's log). For the slow ones, what arrived by the end.

    .venv/bin/python -m bench.slow_endpoints --slow 100 --healthy 100 --events 50   # the issue's check
    .venv/bin/python -m bench.slow_endpoints --slow 200                             # part of make bench
    .venv/bin/python -m bench.slow_endpoints --slow 100 --slow-ms 0 --slow-status 500  # failing, not slow
    .venv/bin/python -m bench.slow_endpoints --slow 100 --max-endpoint-queues 20   # 80 held past the bound

The broker needs about three file handles per endpoint queue (RabbitMQ 3.x counts them): 300 endpoints
fit a broker as a distribution installs it (927).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aio_pika

from bench.run import TENANT, Services, events_exchange, percentile, register_each, start_sink, vhost

EVENT_TYPE = "iso.tick"


async def publish(amqp_url: str, count: int, rate_per_s: float) -> dict[str, float]:
    """``count`` events, ``rate_per_s`` a second: each is a write to every endpoint's queue, and a burst
    of them would measure how fast the broker fans out (about 550 queue writes/s on this machine with
    the rest running), not how the dispatchers share their connections."""
    sent: dict[str, float] = {}
    started = time.monotonic()
    async with events_exchange(amqp_url) as exchange:
        for n in range(count):
            await asyncio.sleep(max(0.0, started + n / rate_per_s - time.monotonic()))
            event_id = f"evt_iso_{n}"
            body = json.dumps(
                {"id": event_id, "type": EVENT_TYPE, "tenant": TENANT,
                 "occurred_at": "2026-12-01T00:00:00Z", "data": {"n": n}}
            ).encode()  # fmt: skip
            sent[event_id] = time.time()
            await exchange.publish(
                aio_pika.Message(
                    body, content_type="application/json", message_id=event_id,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                f"{TENANT}.{EVENT_TYPE}",
            )  # fmt: skip
    return sent


def log_lines(work: Path, prefix: str) -> list[dict[str, Any]]:
    lines = []
    for path in work.glob(f"{prefix}*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                lines.append(json.loads(line))
    return lines


async def wait_for(sink_count: Any, expected: int, deadline_s: float) -> None:
    while time.monotonic() < deadline_s:
        if await sink_count() >= expected:
            return
        await asyncio.sleep(0.2)


async def run(amqp_url: str, *, slow: int, healthy: int, events: int, rate_per_s: float, slow_ms: int,
              dispatchers: int, wait_s: float, slow_status: int = 204,
              max_endpoint_queues: int | None = None) -> dict[str, Any]:  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="hookline-isolation-"))
    print(f"logs in {work}", flush=True)
    healthy_sink, slow_sink = start_sink(work), start_sink(work, status=slow_status, delay_ms=slow_ms)
    # Defaults for everything that decides isolation; the bench's own short retry step is not used.
    settings = {"HOOKLINE_RETRY_SCHEDULE_S": "30,120,600,1800,7200,21600"}
    if max_endpoint_queues is not None:
        settings["HOOKLINE_MAX_ENDPOINT_QUEUES"] = str(max_endpoint_queues)
    services = Services(amqp_url, work, settings=settings)
    try:
        services.start_ingest()
        services.start_monitor()
        healthy_ids = await register_each(
            services, [(f"http://127.0.0.1:{healthy_sink.port}/h{n}", ["iso.*"]) for n in range(healthy)]
        )
        await register_each(
            services, [(f"http://127.0.0.1:{slow_sink.port}/s{n}", ["iso.*"]) for n in range(slow)]
        )
        services.start_dispatchers(dispatchers)
        started = time.monotonic()
        sent = await publish(amqp_url, events, rate_per_s)
        expected = healthy * events
        await wait_for(healthy_sink.count, expected, started + wait_s)
        healthy_done_s = time.monotonic() - started
        await asyncio.sleep(5)  # what the slow ones got meanwhile, and the monitor's last word
    finally:
        services.stop_all()
        arrived = healthy_sink.finish()["arrivals"]
        slow_arrived = slow_sink.finish()["arrivals"]
    by_event: dict[str, list[float]] = {}
    for key, at in arrived.items():
        event_id = key.split(" ", 1)[1]
        if event_id in sent:
            by_event.setdefault(event_id, []).append(at)
    latencies_ms = [(at - sent[event_id]) * 1000 for event_id, ats in by_event.items() for at in ats]
    # Where the time goes: until the first of an event's healthy deliveries (the broker writing it to
    # every endpoint's queue, a dispatcher taking it), then until the last (the dispatchers' work).
    first_ms = [(min(ats) - sent[event_id]) * 1000 for event_id, ats in by_event.items()]
    spread_ms = [(max(ats) - min(ats)) * 1000 for ats in by_event.values()]
    healthy_set = set(healthy_ids)
    attempts = [r for r in log_lines(work, "dispatcher") if r.get("event") == "delivery_attempt"]
    healthy_attempts = [r for r in attempts if r.get("endpoint_id") in healthy_set]
    breakers = [
        r for r in log_lines(work, "health-monitor")
        if r.get("event") == "breaker_changed" and r.get("endpoint_id") in healthy_set
    ]  # fmt: skip
    isolations = [
        r for prefix in ("dispatcher", "health-monitor") for r in log_lines(work, prefix)
        if r.get("event") == "endpoint_isolated"
    ]  # fmt: skip
    return {
        "slow_endpoints": slow,
        "isolated_with_queues": sum(not r.get("held") for r in isolations),
        "isolated_held": sum(bool(r.get("held")) for r in isolations),
        "slow_ms": slow_ms,
        "slow_status": slow_status,
        "healthy_endpoints": healthy,
        "events": events,
        "events_per_s": rate_per_s,
        "dispatchers": dispatchers,
        "healthy_expected": expected,
        "healthy_delivered": len(latencies_ms),
        "healthy_all_delivered_s": round(healthy_done_s, 1) if len(latencies_ms) >= expected else None,
        "healthy_p50_ms": round(percentile(latencies_ms, 0.50), 1),
        "healthy_p99_ms": round(percentile(latencies_ms, 0.99), 1),
        "healthy_max_ms": round(max(latencies_ms), 1),
        "first_delivery_of_an_event_p50_ms": round(percentile(first_ms, 0.50), 1),
        "first_to_last_delivery_of_an_event_p50_ms": round(percentile(spread_ms, 0.50), 1),
        "healthy_failed_attempts": sum(r.get("outcome") != "success" for r in healthy_attempts),
        "healthy_timeouts": sum(r.get("error") == "timeout" for r in healthy_attempts),
        "healthy_retries_scheduled": sum(r.get("next_attempt_in_s") is not None for r in healthy_attempts),
        "healthy_breakers_changed": len(breakers),
        "slow_delivered": len(slow_arrived),
        "logs": str(work),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--amqp-url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--slow", type=int, default=100)
    parser.add_argument("--healthy", type=int, default=100)
    parser.add_argument("--events", type=int, default=50)
    parser.add_argument("--rate-per-s", type=float, default=2.0, help="events published a second")
    parser.add_argument("--slow-ms", type=int, default=8000)
    parser.add_argument(
        "--slow-status", type=int, default=204, help="what the others answer (500 with --slow-ms 0: failing)"
    )
    parser.add_argument("--dispatchers", type=int, default=2)
    parser.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for the healthy ones")
    parser.add_argument(
        "--max-endpoint-queues",
        type=int,
        help="HOOKLINE_MAX_ENDPOINT_QUEUES (past it: held in holding lanes)",
    )
    parser.add_argument(
        "--alone-too", action="store_true", help="first the healthy endpoints alone: the same run's baseline"
    )
    arguments = parser.parse_args()
    print(json.dumps(measure(arguments), indent=2))


def measure(arguments: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for label, slow in (("alone", 0), ("beside_slow", arguments.slow)):
        if label == "alone" and not arguments.alone_too:
            continue
        print(f"{arguments.healthy} healthy endpoints {label.replace('_', ' ')}…", flush=True)
        with vhost(arguments.amqp_url) as amqp_url:
            results[label] = asyncio.run(
                run(amqp_url, slow=slow, healthy=arguments.healthy, events=arguments.events,
                    rate_per_s=arguments.rate_per_s, slow_ms=arguments.slow_ms,
                    dispatchers=arguments.dispatchers, wait_s=arguments.wait_s,
                    slow_status=getattr(arguments, "slow_status", 204),
                    max_endpoint_queues=getattr(arguments, "max_endpoint_queues", None))
            )  # fmt: skip
    return results


if __name__ == "__main__":
    main()
