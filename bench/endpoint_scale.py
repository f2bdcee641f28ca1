"""How hookline scales in endpoints: N endpoints registered (queue, route exchanges, bindings, change
log record) as the ingest registers them, then a dispatcher replica started against them.

Reported: registration rate, broker memory per endpoint (each node: ``rabbitmqctl status``, before and
after), the dispatcher's time to attach to every queue (``hookline_dispatcher_consumers`` reaching N)
and its RSS once attached, and its CPU while idle for 30 s. With ``--active A`` (default 100), A of the
N endpoints point at a local receiver, and two bursts of events to them are delivered with only those
A registered, then two more with all N (the other N−A idle); the ratio of the medians is reported: the
throughput to active endpoints should not depend on how many idle ones share the broker and the
dispatcher.

    .venv/bin/python -m bench.endpoint_scale --endpoints 10000 --cluster   # scripts/start-rabbitmq-cluster.sh

One node started by the same script (own directory and port, the file-handle limit raised):

    export HOOKLINE_CLUSTER_NODES=1 HOOKLINE_CLUSTER_DIR=/var/lib/rabbitmq/hookline-single HOOKLINE_CLUSTER_PORT=5691
    scripts/start-rabbitmq-cluster.sh && .venv/bin/python -m bench.endpoint_scale --endpoints 10000 --cluster

Needs a vhost of its own (made and deleted here) and a broker whose file-handle limit exceeds N (each
quorum queue takes one on RabbitMQ 3.x; the cluster script starts its nodes with the hard limit).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import uvloop

from bench.run import TENANT, Sink, drain, publish_burst, rates, start_sink, stop
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.broker.topology import Retention
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import SigningSecret, StoredEndpoint
from hookline.shared.outbound.signing import generate_secret
from hookline.shared.runtime.supervision import Supervisor
from hookline.shared.state import registry

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "start-rabbitmq-cluster.sh"
CONCURRENCY = 32


def ctl(node: str | None, *arguments: str) -> str:
    command = [str(CLUSTER), "ctl", node, *arguments] if node else ["rabbitmqctl", "-q", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stdout


def memory_bytes(nodes: list[str | None]) -> dict[str, int]:
    """Each node's resident memory: from the OS for the script's nodes (``rabbitmqctl status`` takes
    minutes with 10,000 quorum queues), else as the node reports it."""
    if nodes[0] is None:
        status = json.loads(ctl(None, "status", "--formatter", "json"))
        return {"None": int(status["memory"]["total"]["rss"])}
    base = Path(os.environ.get("HOOKLINE_CLUSTER_DIR", "/var/lib/rabbitmq/hookline-cluster"))
    return {
        str(node): int(rss_mib(int((base / str(node) / "pid").read_text())) * 1024 * 1024) for node in nodes
    }


def endpoint(n: int, receiver: str | None = None) -> StoredEndpoint:
    """Endpoint n: idle (a receiver never called) or, given a receiver, active with its own event type
    ``load.e<n>`` in the benchmark tenant (as ``bench.run.publish_burst`` addresses them)."""
    now = datetime.now(UTC)
    return StoredEndpoint(
        id=new_id("ep"),
        tenant=TENANT if receiver else f"t{n % 100}",
        url=receiver or "https://receiver.example/hooks",
        event_types=[f"load.e{n}"] if receiver else ["order.*"],
        created_at=now,
        updated_at=now,
        secrets=[SigningSecret(value=generate_secret(), created_at=now)],
        routed=True,
        laned=True,
    )


async def register(url: str, count: int, receiver: str | None = None) -> float:
    """Declare and bind each endpoint, then write its record, as the ingest does; the seconds taken."""
    supervisor = Supervisor()
    async with Broker(url, name="hookline-bench", connect_timeout_s=30) as broker:
        await topology.declare(broker, Retention())
        publisher = Publisher(broker)
        change_log = await registry.follow(
            broker, publisher, supervisor, registry.EndpointRegistry(), sync_timeout_s=60
        )
        pending = list(range(count))
        started = time.perf_counter()

        async def worker() -> None:
            async with broker.channel() as channel:
                while pending:
                    stored = endpoint(pending.pop(), receiver)
                    await topology.provision(channel, stored, isolated=False)
                    await change_log.upsert(stored, base_version=0, timeout_s=120)

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        elapsed = time.perf_counter() - started
        await supervisor.stop()
        await publisher.close()
    return elapsed


async def broker_answers(url: str, timeout_s: float = 900) -> float:
    """Seconds until an AMQP connection and a channel succeed again (the first of the URLs)."""
    started = time.perf_counter()
    while True:
        try:
            connection = await asyncio.wait_for(aio_pika.connect(url.split(",")[0]), 10)
            async with connection:
                await asyncio.wait_for(connection.channel(), 10)
            return time.perf_counter() - started
        except (TimeoutError, OSError, aio_pika.exceptions.AMQPError):
            if time.perf_counter() - started > timeout_s:
                raise
            await asyncio.sleep(1)


def dispatcher(url: str, state_dir: str, port: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLINE_")}
    env |= {
        "HOOKLINE_AMQP_URL": url,
        "HOOKLINE_DISPATCHER_METRICS_PORT": str(port),
        "HOOKLINE_STATE_DIR": state_dir,
        "HOOKLINE_LOG_LEVEL": "warning",
        "HOOKLINE_CONNECT_TIMEOUT_S": "300",  # a broker busy after 10,000 declarations
        "HOOKLINE_ALLOW_HTTP": "true",  # the active endpoints' receiver is on 127.0.0.1
        "HOOKLINE_ALLOW_PRIVATE_TARGETS": "true",
    }
    hookline = str(Path(sys.executable).with_name("hookline"))
    log = Path(state_dir) / "dispatcher.log"
    return subprocess.Popen(
        [hookline, "dispatcher"], env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )


def consumers(port: int) -> int:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return -1
    for line in text.splitlines():
        if line.startswith("hookline_dispatcher_consumers "):
            return int(float(line.split()[1]))
    return -1


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def attach(process: subprocess.Popen[bytes], port: int, log: Path, count: int) -> float:
    """Seconds until the dispatcher consumes ``count`` queues."""
    started = time.perf_counter()
    while consumers(port) < count:
        if process.poll() is not None:
            tail = log.read_text()[-3000:]  # noqa: ASYNC240 - the run is over
            raise RuntimeError(f"the dispatcher exited ({process.returncode}): {tail}")
        if time.perf_counter() - started > 900:
            raise RuntimeError(f"attached to {consumers(port)} of {count} in 900 s")
        await asyncio.sleep(0.5)
    return time.perf_counter() - started


@contextlib.contextmanager
def running(process: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    try:
        yield process
    finally:
        stop(process)


async def bursts(url: str, sink: Sink, active: int, events: int, label: str) -> list[dict[str, float]]:
    """Two bursts of ``events`` to the active endpoints, each drained; what was sent when."""
    sent = []
    for n in range(2):
        delivered_before = await sink.count()
        sent.append(await publish_burst(url, events, active, f"{label}{n}_"))
        await drain(sink, delivered_before + events)
    return sent


def steady(sent: list[dict[str, float]], arrivals: dict[str, float]) -> list[float]:
    return [rates(burst, arrivals, backlog=False)["steady_per_s"] for burst in sent]


async def main(count: int, cluster: bool, active: int, events: int) -> dict[str, Any]:
    size = int(os.environ.get("HOOKLINE_CLUSTER_NODES", "3"))
    nodes: list[str | None] = list[str | None](["a", "b", "c"][:size]) if cluster else [None]
    vhost = f"bench-scale-{uuid.uuid4().hex[:8]}"
    ctl(nodes[0], "add_vhost", vhost)
    ctl(nodes[0], "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    first_port = int(os.environ.get("HOOKLINE_CLUSTER_PORT", "5681"))
    ports = [first_port + n for n in range(size)] if cluster else [5672]
    url = ",".join(f"amqp://guest:guest@127.0.0.1:{port}/{vhost}" for port in ports)
    port = 18990
    try:
        with tempfile.TemporaryDirectory() as state_dir:
            log = Path(state_dir) / "dispatcher.log"
            sink = start_sink(Path(state_dir))
            try:
                await register(url, active, f"http://127.0.0.1:{sink.port}/hook")
                with running(dispatcher(url, state_dir, port)) as process:
                    await attach(process, port, log, active)
                    alone = await bursts(url, sink, active, events, "alone")

                before = memory_bytes(nodes)
                register_s = await register(url, count - active)
                # After a burst of declarations the broker may not take a connection for a while
                # (RabbitMQ 3.10 moving 10,000 queues' entries from its write-ahead log into their
                # segment files): measured.
                settled_s = await broker_answers(url)
                after = memory_bytes(nodes)

                with running(dispatcher(url, state_dir, port)) as process:
                    attach_s = await attach(process, port, log, count)
                    attached_rss = rss_mib(process.pid)
                    cpu_before = cpu_s(process.pid)
                    await asyncio.sleep(30)
                    idle_cpu = (cpu_s(process.pid) - cpu_before) / 30
                    among = await bursts(url, sink, active, events, "among")
                    loaded_rss = rss_mib(process.pid)
            finally:
                arrivals = sink.finish()["arrivals"]
        idle = count - active
        alone_rates, among_rates = steady(alone, arrivals), steady(among, arrivals)
        return {
            "endpoints": count,
            "nodes": len(nodes),
            "register_s": round(register_s, 1),
            "registered_per_s": round(idle / register_s, 1),
            "broker_took_connections_again_after_s": round(settled_s, 1),
            "broker_rss_per_endpoint_kib": {
                node: round((after[node] - before[node]) / idle / 1024, 1) for node in after
            },
            "dispatcher_attach_s": round(attach_s, 1),
            "dispatcher_rss_mib": round(attached_rss, 1),
            "dispatcher_rss_after_bursts_mib": round(loaded_rss, 1),
            "dispatcher_idle_cpu": round(idle_cpu, 3),  # share of one core
            "active_endpoints": active,
            "burst_events": events,
            "active_alone_per_s": [round(rate) for rate in alone_rates],
            "active_among_idle_per_s": [round(rate) for rate in among_rates],
            "among_idle_vs_alone": round(statistics.median(among_rates) / statistics.median(alone_rates), 2),
        }
    finally:
        ctl(nodes[0], "delete_vhost", vhost)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoints", type=int, default=1000)
    parser.add_argument("--active", type=int, default=100, help="endpoints receiving events")
    parser.add_argument("--events", type=int, default=20000, help="events in each burst to them")
    parser.add_argument(
        "--cluster", action="store_true", help="the nodes of scripts/start-rabbitmq-cluster.sh"
    )
    args = parser.parse_args()
    print(
        "ENDPOINT_SCALE",
        json.dumps(uvloop.run(main(args.endpoints, args.cluster, args.active, args.events))),
    )


if __name__ == "__main__":
    cli()
