"""Where the CPU goes per delivery, live: CPU seconds of every process (the broker, the ingest, each of
2 dispatchers, the receiver, the publisher) while 10 endpoints of a tenant get events published as they
are delivered, divided by the deliveries; beside the bare loop consuming while published, in the same
run. ``--binary`` runs another version's ``hookline`` (its own venv)
alternated with this one, each in a vhost of its own.

    .venv/bin/python -m bench.cpu --events 10000 --runs 2 [--binary ../before/.venv/bin/hookline]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aio_pika
import uvloop

import bench.baseline
from bench.lanes import broker_pid, cpu_s
from bench.run import (
    HOOKLINE,
    Services,
    delete_endpoints,
    drain,
    publish_burst,
    rates,
    register_for,
    start_sink,
    vhost,
)

ENDPOINTS = 10


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_s(pid) for name, pid in pids.items()}


def _per_delivery_us(before: dict[str, float], after: dict[str, float], deliveries: int) -> dict[str, int]:
    return {name: round((after[name] - before[name]) / deliveries * 1e6) for name in before}


async def hookline_run(amqp_url: str, work: Path, binary: str, count: int) -> dict[str, Any]:
    services = Services(amqp_url, work, binary=binary)
    services.start_ingest()
    sink = start_sink(work)
    try:
        await register_for(services, sink, ENDPOINTS)
        services.start_dispatchers(2)
        pids = {
            "broker": broker_pid(),
            "ingest": services.processes[0].pid,
            **{f"dispatcher-{n}": p.pid for n, p in enumerate(services.dispatchers)},
            "receiver": sink.process.pid,
            "publisher": os.getpid(),
        }
        before, started = _cpu(pids), time.monotonic()
        sent = await publish_burst(amqp_url, count, ENDPOINTS, "cpu")
        await drain(sink, count)
        elapsed_s, after = time.monotonic() - started, _cpu(pids)
    finally:
        result = sink.finish()
        await delete_endpoints(services)
        services.stop_all()
    return {
        "delivered": count,
        "deliveries_per_s": round(rates(sent, result["arrivals"], backlog=False)["deliveries_per_s"]),
        "elapsed_s": round(elapsed_s, 1),
        "cpu_us_per_delivery": _per_delivery_us(before, after, count),
    }


async def bare_live_run(amqp_url: str, work: Path, count: int) -> dict[str, Any]:
    sink = start_sink(work)
    loop = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.baseline", amqp_url, str(count), "64",
        f"http://127.0.0.1:{sink.port}/", "live", stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert loop.stdout is not None
        await loop.stdout.readline()
        pids = {"broker": broker_pid(), "receiver": sink.process.pid, "publisher": os.getpid()}
        before, started = _cpu(pids), time.monotonic()
        connection = await aio_pika.connect_robust(amqp_url)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            await bench.baseline.publish(channel, count)
        output, _ = await asyncio.wait_for(loop.communicate(), 600)
        elapsed_s, after = time.monotonic() - started, _cpu(pids)
    finally:
        if loop.returncode is None:
            loop.kill()
        sink.finish()
    per_delivery = _per_delivery_us(before, after, count)
    per_delivery["loop"] = round(json.loads(output)["cpu_s"] / count * 1e6)
    return {"deliveries_per_s": round(count / elapsed_s), "cpu_us_per_delivery": per_delivery}


async def main(arguments: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    work = Path(tempfile.mkdtemp(prefix="hookline-cpu-"))
    print(f"logs in {work}", flush=True)
    versions = {"this": HOOKLINE, **({"other": arguments.binary} if arguments.binary else {})}
    report: dict[str, list[dict[str, Any]]] = {"bare_live": []}
    for repeat in range(arguments.runs):
        with vhost(arguments.amqp_url) as amqp_url:
            report["bare_live"].append(await bare_live_run(amqp_url, work, arguments.events))
            print("bare live", report["bare_live"][-1], flush=True)
        for name, binary in versions.items():
            with vhost(arguments.amqp_url) as amqp_url:
                row = await hookline_run(amqp_url, work, binary, arguments.events)
            report.setdefault(name, []).append(row)
            print(name, f"run {repeat + 1}", row, flush=True)
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--amqp-url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--binary", help="another version's hookline, run alternated with this one")
    print(json.dumps(uvloop.run(main(parser.parse_args())), indent=2))
