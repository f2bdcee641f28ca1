"""How long a health monitor takes to be ready, and how much memory it holds, with a long history behind it.

The telemetry log is filled with N attempt records (batches as dispatchers send them, spread over the
last 23 hours and 500 endpoints) and the dead-letter stream with M dead letters, then a monitor is
started three times: first with no local state (it rebuilds its views from the streams), then after a
clean stop (SIGTERM writes a checkpoint), then after SIGKILL (it resumes from its last periodic
checkpoint). Reported: seconds from process start to ``/readyz`` 200, and RSS once ready.

    .venv/bin/python -m bench.monitor_restart --records 1000000 --dead-letters 100000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import uvloop

from bench.run import HOOKLINE, TOKEN, free_port, rss_mib, vhost, wait_ready
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker
from hookline.shared.contracts.deadletters import dead_letter_message
from hookline.shared.contracts.models import DeadLetterReason
from hookline.shared.contracts.telemetry import AttemptRecord, batch

BATCH = 500  # records per telemetry message, as a busy dispatcher sends them
WINDOW = 200  # confirms awaited together
ENDPOINTS = 500
TYPES = 50


async def fill(amqp_url: str, records: int, dead_letters: int) -> dict[str, float]:
    rng = random.Random(7)
    now_s = time.time()
    async with Broker(amqp_url, name="bench-fill", connect_timeout_s=30) as broker:
        await topology.declare(broker, topology.Retention())  # the services' default
        async with broker.channel(confirms=True) as channel:
            telemetry = await channel.get_exchange(topology.TELEMETRY_EXCHANGE, ensure=False)
            dead = await channel.get_exchange(topology.DEAD_LETTER_EXCHANGE, ensure=False)
            started = time.monotonic()
            pending = []
            for first in range(0, records, BATCH):
                chunk = [
                    AttemptRecord.model_construct(
                        kind="attempt",
                        at_s=now_s - rng.uniform(0, 23 * 3600),
                        dispatcher_id="bench",
                        event_id=f"evt_{n}",
                        endpoint_id=f"ep_{n % ENDPOINTS:026d}",
                        tenant="bench",
                        type=f"load.t{n % TYPES}",
                        attempt=1,
                        outcome="success" if rng.random() > 0.05 else "retry",
                        status=204,
                        error=None,
                        duration_ms=rng.lognormvariate(2.5, 0.8),
                        dns_ms=None,
                        connect_ms=None,
                        first_byte_ms=None,
                        first_attempt_at_s=now_s,
                        next_attempt_at_s=None,
                        dead_letter_reason=None,
                        probe=False,
                    )
                    for n in range(first, min(first + BATCH, records))
                ]
                body = batch.dump_json(chunk)  # type: ignore[arg-type]
                pending.append(telemetry.publish(aio_pika.Message(body, content_type="application/json"), ""))
                if len(pending) >= WINDOW:
                    await asyncio.gather(*pending)
                    pending = []
            await asyncio.gather(*pending)
            telemetry_s = time.monotonic() - started
            started = time.monotonic()
            pending = []
            for n in range(dead_letters):
                message = dead_letter_message(
                    b'{"id": "evt_x", "type": "load.t1", "tenant": "bench"}',
                    reason=DeadLetterReason.MAX_ATTEMPTS,
                    endpoint_id=f"ep_{n % ENDPOINTS:026d}",
                    tenant="bench",
                    event_id=f"evt_dead_{n}",
                    attempts=5,
                    last_status=500,
                    last_error="HTTP 500",
                    now=datetime.now(UTC),
                )
                pending.append(dead.publish(message, ""))
                if len(pending) >= WINDOW:
                    await asyncio.gather(*pending)
                    pending = []
            await asyncio.gather(*pending)
            dead_s = time.monotonic() - started
    return {"telemetry_fill_s": round(telemetry_s, 1), "dead_letter_fill_s": round(dead_s, 1)}


def start_monitor(amqp_url: str, work: Path, port: int, name: str) -> tuple[subprocess.Popen[bytes], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLINE_")}
    env.update(
        HOOKLINE_AMQP_URL=amqp_url,
        HOOKLINE_API_TOKEN=TOKEN,
        HOOKLINE_MONITOR_PORT=str(port),
        HOOKLINE_STATE_DIR=str(work / "state"),
        HOOKLINE_CONNECT_TIMEOUT_S="60",
    )
    started = time.monotonic()
    process = subprocess.Popen(
        [HOOKLINE, "health-monitor"],
        env=env,
        stdout=(work / f"{name}.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    wait_ready(port, process, timeout_s=1800)
    return process, time.monotonic() - started


async def measure(amqp_url: str, work: Path, records: int, dead_letters: int) -> dict[str, Any]:
    result: dict[str, Any] = {"telemetry_records": records, "dead_letters": dead_letters}
    result.update(await fill(amqp_url, records, dead_letters))
    port = free_port()
    for phase, ending in (
        ("rebuild", signal.SIGTERM),
        ("restart", signal.SIGKILL),
        ("after_kill", signal.SIGTERM),
    ):
        process, ready_s = start_monitor(amqp_url, work, port, f"monitor-{phase}")
        result[f"{phase}_ready_s"] = round(ready_s, 2)
        result[f"{phase}_rss_mib"] = round(rss_mib(process), 1)
        if ending == signal.SIGKILL:
            await asyncio.sleep(32)  # a periodic checkpoint (every 30 s) has been written
        process.send_signal(ending)
        process.wait(120)
        print(f"  {phase}: ready in {ready_s:.2f} s, RSS {result[f'{phase}_rss_mib']} MiB", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--amqp-url", default=os.environ.get("HOOKLINE_AMQP_URL", "amqp://guest:guest@localhost:5672/")
    )
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--dead-letters", type=int, default=100_000)
    arguments = parser.parse_args()
    with vhost(arguments.amqp_url) as amqp_url:
        work = Path(tempfile.mkdtemp(prefix="hookline-bench-monitor-"))
        result = uvloop.run(measure(amqp_url, work, arguments.records, arguments.dead_letters))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
