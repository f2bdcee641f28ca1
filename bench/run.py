"""``make bench``: the real system under load, with the ceilings and peers measured in the same run.

1. client micro-benchmark: httpx, httpx over the aiohttp transport, aiohttp (same receiver);
2. the bare consume → sign → POST → ack loop (the ceiling of one process);
3. hookline end to end with 1 and 2 dispatcher replicas: N events published to ``events`` over AMQP
   while the queues are consumed, deliveries/s measured at the receiver;
4. publish-to-delivery latency at a paced 500 events/s (p50/p95/p99);
5. dispatcher memory with 1,000 registered endpoints, idle and after traffic to all of them;
6. health monitor start-up and memory with 1,000,000 telemetry records and 100,000 dead letters behind
   it: rebuilt from the streams, restarted from its checkpoint, restarted after SIGKILL
   (bench/monitor_restart.py);
7. the ingest's delivery log with 1,000,000 attempts stored: query latencies and disk
   (bench/delivery_log.py);
8. the outbox relay: 10,000 rows from PostgreSQL to ``events``, beside an upstream publishing the same
   directly (bench/outbox.py);
9. the health monitor's memory under sustained telemetry (300 events/s, 50 endpoints of which 5 fail,
   2,000 event types): RSS over 6 minutes and its slope over the second half (bench/monitor_soak.py;
   ``--soak-s 3600`` for the hour).

Everything runs in a vhost of its own, deleted afterwards. Results: bench/results/latest.{json,md}.
Numbers drift on a shared 2-core machine: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import uvloop

import bench.baseline
from bench import versions
from hookline.shared.broker import topology

ROOT = Path(__file__).resolve().parents[1]
HOOKLINE = str(Path(sys.executable).with_name("hookline"))
TOKEN = "bench-token-0123456789abcdef"  # noqa: S105 - a throwaway token for a throwaway vhost
TENANT = "bench"
RESULTS = ROOT / "bench" / "results"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rabbitmqctl(*arguments: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *arguments], check=True, capture_output=True, timeout=120)


@contextlib.contextmanager
def vhost(base_url: str) -> Iterator[str]:
    name = f"hookline-bench-{uuid.uuid4().hex[:8]}"
    rabbitmqctl("add_vhost", name)
    rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
    try:
        yield base_url.rstrip("/") + "/" + name
    finally:
        rabbitmqctl("delete_vhost", name)


@dataclass
class Sink:
    port: int
    out: Path
    process: subprocess.Popen[bytes]

    async def count(self) -> int:
        """Requests received so far."""
        async with httpx.AsyncClient() as http:
            return int((await http.get(f"http://127.0.0.1:{self.port}/__count")).text)

    def finish(self) -> dict[str, Any]:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(30)
        result: dict[str, Any] = json.loads(self.out.read_text())
        return result


def start_sink(work: Path, status: int = 204, delay_ms: int = 0, *, own_session: bool = False) -> Sink:
    port = free_port()
    out = work / f"sink-{port}.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.sink", str(port), str(out), str(status), str(delay_ms)],
        stdout=subprocess.PIPE,
        start_new_session=own_session,  # see Services.own_sessions
    )
    assert process.stdout is not None
    process.stdout.readline()  # "ready"
    return Sink(port, out, process)


@dataclass
class Services:
    amqp_url: str
    work: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    dispatchers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    ingest_port: int = 0

    settings: dict[str, str] = field(default_factory=dict)  # over the bench's own (below)
    binary: str = HOOKLINE  # another version's `hookline` (its own venv): compared in the same run
    # Settings of one service only, by its command (ingest, dispatcher, health-monitor), over the rest.
    service_settings: dict[str, dict[str, str]] = field(default_factory=dict)
    # Each service in a session of its own, as deployed (a systemd unit or a container each: a CPU share
    # each). In the bench's session, with the kernel's autogroup on (as here), they would share one CPU
    # share with everything else the bench starts in it.
    own_sessions: bool = False

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLINE_")}
        env.update(
            HOOKLINE_AMQP_URL=self.amqp_url,
            HOOKLINE_API_TOKEN=TOKEN,
            HOOKLINE_ALLOW_HTTP="true",
            HOOKLINE_ALLOW_PRIVATE_TARGETS="true",
            # Short retry steps, so that a failing endpoint's retries compete during the measurement.
            HOOKLINE_RETRY_SCHEDULE_S="1",
        )
        env.update(self.settings)
        env.update(extra)
        return env

    def _spawn(self, command: str, port_variable: str, port: int, name: str) -> subprocess.Popen[bytes]:
        log = (self.work / f"{name}-{port}.log").open("wb")
        process = subprocess.Popen(
            [self.binary, command],
            env=self.env(**self.service_settings.get(command, {}), **{port_variable: str(port)}),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=self.own_sessions,
        )
        wait_ready(port, process)
        self.processes.append(process)
        return process

    def start_ingest(self) -> None:
        self.ingest_port = free_port()
        self._spawn("ingest", "HOOKLINE_INGEST_PORT", self.ingest_port, "ingest")

    def start_monitor(self) -> subprocess.Popen[bytes]:
        return self._spawn("health-monitor", "HOOKLINE_MONITOR_PORT", free_port(), "health-monitor")

    def stop(self, process: subprocess.Popen[bytes]) -> None:
        stop(process)
        self.processes.remove(process)

    def start_dispatchers(self, count: int) -> None:
        for n in range(count):
            port = free_port()
            self.dispatchers.append(
                self._spawn("dispatcher", "HOOKLINE_DISPATCHER_METRICS_PORT", port, f"dispatcher-{n}")
            )

    def stop_dispatchers(self) -> None:
        for process in self.dispatchers:
            stop(process)
            self.processes.remove(process)
        self.dispatchers.clear()

    def stop_all(self) -> None:
        for process in self.processes:
            stop(process)
        self.processes.clear()
        self.dispatchers.clear()

    def api(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{self.ingest_port}",
            headers={"authorization": f"Bearer {TOKEN}"},
            timeout=60,
        )


def wait_ready(port: int, process: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"a service exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError("a service did not become ready")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def rss_mib(process: subprocess.Popen[bytes]) -> float:
    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def register(services: Services, count: int, url: str, *, first: int = 0) -> None:
    """Endpoints n = first … first+count-1, each subscribed to its own type ``load.e<n>``."""
    await register_each(services, [(url, [f"load.e{n}"]) for n in range(first, first + count)])


async def register_each(services: Services, endpoints: list[tuple[str, list[str]]]) -> list[str]:
    """One endpoint of the benchmark tenant per (url, event types), 8 at a time; their ids."""
    ids: list[str] = []
    async with services.api() as api:
        semaphore = asyncio.Semaphore(8)

        async def one(url: str, event_types: list[str]) -> None:
            async with semaphore:
                response = await api.post(
                    "/v1/endpoints",
                    json={"tenant": TENANT, "url": url, "event_types": event_types, "verify": False},
                )
                response.raise_for_status()
                ids.append(response.json()["id"])

        await asyncio.gather(*(one(url, event_types) for url, event_types in endpoints))
    return ids


def event_body(event_id: str, endpoint_n: int, event_type: str | None = None) -> bytes:
    return json.dumps(
        {
            "id": event_id,
            "type": event_type or f"load.e{endpoint_n}",
            "tenant": TENANT,
            "occurred_at": "2026-11-29T18:00:00Z",
            "data": {"x": "a" * 1000},
        }
    ).encode()


@contextlib.asynccontextmanager
async def events_exchange(amqp_url: str) -> AsyncIterator[aio_pika.abc.AbstractExchange]:
    connection = await aio_pika.connect_robust(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        yield await channel.get_exchange("events")


def message(event_id: str, endpoint_n: int, event_type: str | None = None) -> aio_pika.Message:
    return aio_pika.Message(
        event_body(event_id, endpoint_n, event_type),
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=event_id,
    )


async def publish_burst(
    amqp_url: str, count: int, endpoints: int, prefix: str, *, fanout: bool = False
) -> dict[str, float]:
    """Publish ``count`` events as fast as confirms allow (window 500), each to its own endpoint's type
    (``fanout``: count/endpoints events of the type all of them have); returns id → publish time."""
    sent: dict[str, float] = {}
    async with events_exchange(amqp_url) as exchange:
        pending = []
        for n in range(count // endpoints if fanout else count):
            event_id = f"{prefix}{n}"
            sent[event_id] = time.time()
            published = (
                (message(event_id, 0, "load.fan"), f"{TENANT}.load.fan")
                if fanout
                else (message(event_id, n % endpoints), f"{TENANT}.load.e{n % endpoints}")
            )
            pending.append(exchange.publish(*published))
            if len(pending) >= 500:
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)
    return sent


async def publish_paced(
    amqp_url: str, rate_per_s: int, duration_s: float, endpoints: int
) -> dict[str, float]:
    sent: dict[str, float] = {}
    tick_s = 0.01
    per_tick = max(1, round(rate_per_s * tick_s))
    async with events_exchange(amqp_url) as exchange:
        tasks = []
        started = time.monotonic()
        n = 0
        while (elapsed := time.monotonic() - started) < duration_s:
            due = int(elapsed * rate_per_s) + per_tick
            while n < due:
                event_id = f"paced{n}"
                sent[event_id] = time.time()
                endpoint_n = n % endpoints
                tasks.append(
                    asyncio.ensure_future(
                        exchange.publish(message(event_id, endpoint_n), f"{TENANT}.load.e{endpoint_n}")
                    )
                )
                n += 1
            await asyncio.sleep(tick_s)
        await asyncio.gather(*tasks)
    return sent


def rates(
    sent: dict[str, float], arrived: dict[str, float], *, backlog: bool, fanout: int = 0
) -> dict[str, Any]:
    """Deliveries/s at the receiver: from the first arrival (a backlog) or the first publish (live) to
    the last arrival, and the steady rate. ``fanout``: each event went to that many endpoints, each on a
    path of its own (/f<n>)."""
    if fanout:
        arrivals = [at for key, at in arrived.items() if key.split(" ", 1)[-1] in sent]
    else:
        arrivals = [arrived[event_id] for event_id in sent if event_id in arrived]
    first = min(arrivals) if backlog else min(sent.values())
    return {
        "delivered": len(arrivals),
        "deliveries_per_s": len(arrivals) / (max(arrivals) - first),
        "steady_per_s": steady_rate(arrivals),
    }


def steady_rate(arrivals: list[float]) -> float:
    """Deliveries/s between the 10th and the 90th percentile arrival: the rate once every consumer is
    attached, without a process's start-up or the last stragglers."""
    ordered = sorted(arrivals)
    low, high = len(ordered) // 10, len(ordered) * 9 // 10
    return (high - low) / (ordered[high] - ordered[low])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def throughput(
    services: Services,
    work: Path,
    *,
    dispatchers: int,
    count: int,
    endpoints: int,
    backlog: bool,
    monitor: bool = False,
    failing: bool = False,
    fanout: bool = False,
) -> dict[str, Any]:
    """Deliveries/s at the receiver, to ``endpoints`` healthy endpoints (``fanout``: each event to all of
    them, ``count`` deliveries from count/endpoints events; else each its own type, one each).

    ``backlog``: the events wait in the queues before the dispatchers start (what the bare loop
    measures); otherwise they are published while being delivered. ``monitor``: the health monitor
    runs too. ``failing``: one more endpoint answers 500 to a tenth as many events, and its retries
    (every ~1 s here; no monitor, so no breaker holds them back) run while the healthy ones are measured.
    """
    sink = start_sink(work)
    failing_sink = start_sink(work, status=500) if failing else None
    monitor_process = services.start_monitor() if monitor else None
    prefix = f"tp{dispatchers}{backlog:d}{monitor:d}{failing:d}{fanout:d}_"
    try:
        if fanout:
            await register_each(
                services, [(f"http://127.0.0.1:{sink.port}/f{n}", ["load.fan"]) for n in range(endpoints)]
            )
        else:
            await register_for(services, sink, endpoints)
        if failing_sink is not None:
            await register(services, 1, f"http://127.0.0.1:{failing_sink.port}/hook", first=endpoints)
            async with events_exchange(services.amqp_url) as exchange:
                await asyncio.gather(
                    *(
                        exchange.publish(message(f"fail{n}", endpoints), f"{TENANT}.load.e{endpoints}")
                        for n in range(count // 10)
                    )
                )
        publish = partial(publish_burst, services.amqp_url, count, endpoints, prefix, fanout=fanout)
        if backlog:
            sent = await publish()
            services.start_dispatchers(dispatchers)
        else:
            services.start_dispatchers(dispatchers)
            sent = await publish()
        await drain(sink, count)
    finally:
        result = sink.finish()
        failed_attempts = failing_sink.finish()["count"] if failing_sink is not None else None
        # Deleted while the dispatchers run: each deletion's fence passes its lane at once, so the next
        # configuration's events are not kept as dead letters for these endpoints.
        await delete_endpoints(services)
        await asyncio.sleep(1)
        services.stop_dispatchers()
        if monitor_process is not None:
            services.stop(monitor_process)
    mode = "backlog" if backlog else "live"
    mode += f", each event to {endpoints} endpoints of the tenant" if fanout else ""
    mode += ", health monitor running" if monitor else ""
    mode += (
        f", plus an endpoint answering 500 ({count // 10:,} events, {failed_attempts:,} attempts)"
        if failing
        else ""
    )
    return {
        "mode": mode,
        "dispatchers": dispatchers,
        "events": count,
        **rates(sent, result["arrivals"], backlog=backlog, fanout=endpoints if fanout else 0),
        "failing_endpoint_attempts": failed_attempts,
    }


async def delay_accuracy(amqp_url: str) -> dict[str, Any]:
    """Retries scheduled through the TTL hierarchy, published in a mixed order: how late each arrives."""
    from datetime import UTC, datetime

    from hookline.dispatcher.delays import Delays
    from hookline.shared.broker import topology
    from hookline.shared.broker.amqp import Broker, Publisher
    from hookline.shared.contracts.models import SigningSecret, StoredEndpoint

    delays_s = [13, 1, 8, 2, 5, 3, 1, 13, 8, 5] * 5
    now = datetime.now(UTC)
    endpoint = StoredEndpoint(
        id="ep_" + "D" * 26, tenant=TENANT, url="https://example.com/", event_types=["delay.#"],
        created_at=now, updated_at=now, secrets=[SigningSecret(value="whsec_" + "A" * 44, created_at=now)],
        routed=True, laned=True,
    )  # fmt: skip
    arrived: dict[str, float] = {}
    done = asyncio.Event()
    async with Broker(amqp_url, name="bench-delays", connect_timeout_s=30) as broker:
        publisher = Publisher(broker)
        async with broker.channel() as channel:
            queue = await topology.declare_own_queue(channel, endpoint)

            async def on_message(incoming: aio_pika.abc.AbstractIncomingMessage) -> None:
                arrived[incoming.message_id or ""] = time.monotonic()
                await incoming.ack()
                if len(arrived) == len(delays_s):
                    done.set()

            await queue.consume(on_message)
            delays = Delays(publisher)
            sent: dict[str, tuple[int, float]] = {}
            for n, delay in enumerate(delays_s):
                sent[f"d{n}"] = (delay, time.monotonic())
                await delays.schedule(
                    b"{}", content_type="application/json", timestamp=None, event_id=f"d{n}",
                    endpoint_id=endpoint.id, destination=topology.own_queue(endpoint), next_attempt=2,
                    first_attempt_at_s=time.time(), delay_s=delay,
                )  # fmt: skip
            await asyncio.wait_for(done.wait(), 60)
            await channel.queue_delete(queue.name)
        await publisher.close()
    late_ms = [(arrived[key] - at - delay) * 1000 for key, (delay, at) in sent.items()]
    return {
        "messages": len(late_ms),
        "delays_s": sorted(set(delays_s)),
        "late_ms_mean": statistics.fmean(late_ms),
        "late_ms_min": min(late_ms),
        "late_ms_max": max(late_ms),
    }


async def register_for(services: Services, sink: Sink, endpoints: int) -> None:
    await register(services, endpoints, f"http://127.0.0.1:{sink.port}/hook")


async def delete_endpoints(services: Services) -> None:
    """Every endpoint deleted, and any queue of its own with it: the monitor (not running in most runs)
    would remove them only later, and a version before lanes has one per endpoint, which run after run
    would fill a stock broker's file handles (its ingest then refuses registrations: 503)."""
    async with services.api() as api:
        listed = (await api.get("/v1/endpoints", params={"limit": 1000})).json()["data"]
        for endpoint in listed:
            (await api.delete(f"/v1/endpoints/{endpoint['id']}", params={"force": "true"})).raise_for_status()
    connection = await aio_pika.connect(services.amqp_url)
    async with connection:
        channel = await connection.channel()
        for endpoint in listed:
            await channel.queue_delete(topology.endpoint_queue(endpoint["id"]))


async def drain(sink: Sink, expected: int, timeout_s: float = 600) -> None:
    """Wait until the receiver has had ``expected`` requests since it started."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await sink.count() >= expected:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the receiver did not get {expected} requests in {timeout_s}s")


async def latency(
    services: Services, work: Path, rate_per_s: int, duration_s: float, endpoints: int
) -> dict[str, Any]:
    sink = start_sink(work)
    try:
        await register_for(services, sink, endpoints)
        services.start_dispatchers(2)
        sent = await publish_paced(services.amqp_url, rate_per_s, duration_s, endpoints)
        await drain(sink, len(sent))
        await asyncio.sleep(1)
    finally:
        result = sink.finish()
        await delete_endpoints(services)  # while the dispatchers run (see throughput)
        await asyncio.sleep(1)
        services.stop_dispatchers()
    delays_ms = [(result["arrivals"][i] - t) * 1000 for i, t in sent.items() if i in result["arrivals"]]
    return {
        "offered_per_s": rate_per_s,
        "events": len(sent),
        "delivered": len(delays_ms),
        "p50_ms": percentile(delays_ms, 0.50),
        "p95_ms": percentile(delays_ms, 0.95),
        "p99_ms": percentile(delays_ms, 0.99),
        "max_ms": max(delays_ms),
        "mean_ms": statistics.fmean(delays_ms),
    }


async def memory(services: Services, work: Path, endpoints: int) -> dict[str, Any]:
    sink = start_sink(work)
    try:
        await register(services, endpoints, f"http://127.0.0.1:{sink.port}/hook")
        services.start_dispatchers(1)
        await asyncio.sleep(2)
        idle = rss_mib(services.dispatchers[0])
        await publish_burst(services.amqp_url, endpoints * 5, endpoints, "mem")
        await drain(sink, endpoints * 5)
        busy = rss_mib(services.dispatchers[0])
    finally:
        sink.finish()
        services.stop_dispatchers()
    return {"endpoints": endpoints, "dispatcher_rss_idle_mib": idle, "dispatcher_rss_after_traffic_mib": busy}


def clients(work: Path, count: int, concurrency: int) -> list[dict[str, Any]]:
    sink = start_sink(work)
    url = f"http://127.0.0.1:{sink.port}/hook"
    try:
        return [
            json.loads(
                subprocess.check_output(
                    [sys.executable, "-m", "bench.clients", client, str(count), str(concurrency), url]
                )
            )
            for client in ("httpx", "httpx-aiohttp", "aiohttp")
        ]
    finally:
        sink.finish()


def baseline(amqp_url: str, work: Path, count: int, prefetch: int) -> dict[str, Any]:
    sink = start_sink(work)
    try:
        output = subprocess.check_output(
            [
                sys.executable,
                "-m",
                "bench.baseline",
                amqp_url,
                str(count),
                str(prefetch),
                f"http://127.0.0.1:{sink.port}/",
            ]
        )
    finally:
        sink.finish()
    result: dict[str, Any] = json.loads(output)
    return result


async def live_baseline(amqp_url: str, work: Path, count: int, prefetch: int) -> dict[str, Any]:
    """The bare loop consuming while this process fills its quorum queue, with confirms as hookline's
    live runs are published, and rated as they are: from the first publish to the last arrival."""
    sink = start_sink(work)
    loop = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.baseline", amqp_url, str(count), str(prefetch),
        f"http://127.0.0.1:{sink.port}/", "live", stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert loop.stdout is not None
        await loop.stdout.readline()  # "ready": its consumer is attached
        connection = await aio_pika.connect_robust(amqp_url)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            started = time.time()
            await bench.baseline.publish(channel, count)
        await asyncio.wait_for(loop.wait(), 600)
    finally:
        if loop.returncode is None:
            loop.kill()
        result = sink.finish()
    sent = {f"b{n}": started for n in range(count)}
    return {"mode": "live", "events": count, **rates(sent, result["arrivals"], backlog=False)}


def celery(
    amqp_url: str, work: Path, count: int, pool: str, concurrency: int, *, backlog: bool
) -> dict[str, Any]:
    """The Celery peer (bench/celery_peer.py) against a receiver of its own, rated like hookline."""
    sink = start_sink(work)
    try:
        output = subprocess.check_output(
            [sys.executable, "-m", "bench.celery_peer", amqp_url, str(count), pool, str(concurrency),
             f"http://127.0.0.1:{sink.port}/hook", "backlog" if backlog else "live"],
            cwd=ROOT,
        )  # fmt: skip
    finally:
        result = sink.finish()
    return {
        "pool": pool,
        "concurrency": concurrency,
        "mode": "backlog" if backlog else "live",
        "events": count,
        **rates(json.loads(output)["sent"], result["arrivals"], backlog=backlog),
    }


def median_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run by deliveries/s, with every run's rate beside it (the spread)."""
    rows = sorted(rows, key=lambda row: row["deliveries_per_s"])
    median = dict(rows[len(rows) // 2])
    median["runs_per_s"] = [round(row["deliveries_per_s"]) for row in rows]
    return median


async def delivery_rates(
    arguments: argparse.Namespace,
    report: dict[str, Any],
    amqp_url: str,
    work: Path,
    compared: dict[str, Services],
) -> None:
    """The bare loops, hookline's configurations (each version in ``compared``) and the peer, interleaved
    and repeated, the medians into ``report``; then the latency at half the live rate."""
    configurations: list[dict[str, Any]] = [
        {"dispatchers": 1, "backlog": True},
        {"dispatchers": 2, "backlog": True},
        {"dispatchers": 4, "backlog": True},
        {"dispatchers": 2, "backlog": True, "monitor": True},
        {"dispatchers": 2, "backlog": True, "failing": True},
        {"dispatchers": 2, "backlog": True, "fanout": True, "endpoints": 20},
        {"dispatchers": 2, "backlog": False, "fanout": True, "endpoints": 20},
        {"dispatchers": 1, "backlog": False},
        {"dispatchers": 2, "backlog": False},
    ]
    peers = [
        (pool, concurrency, backlog)
        for pool, concurrency in (("threads", 64), ("prefork", 8))
        for backlog in (True, False)
    ]
    # Interleaved repeats, the median reported: one run on a shared 2-core box can be ±20 %.
    bare_runs: list[dict[str, Any]] = []
    bare_live_runs: list[dict[str, Any]] = []
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {
        (version, n): [] for version in compared for n in range(len(configurations))
    }
    peer_runs: dict[int, list[dict[str, Any]]] = {n: [] for n in range(len(peers))}
    for repeat in range(arguments.repeat):
        print(f"bare loop, run {repeat + 1}/{arguments.repeat}…", flush=True)
        bare_runs.append(baseline(amqp_url, work, arguments.events, 64))
        print(f"bare loop consuming while published, run {repeat + 1}/{arguments.repeat}…", flush=True)
        bare_live_runs.append(await live_baseline(amqp_url, work, arguments.events, 64))
        for n, configuration in enumerate(configurations):
            for version, each in compared.items():
                print(
                    f"throughput {configuration} ({version}), run {repeat + 1}/{arguments.repeat}…",
                    flush=True,
                )
                runs[version, n].append(
                    await throughput(each, work, count=arguments.events, **{"endpoints": 10, **configuration})
                )
        for n, (pool, concurrency, backlog) in enumerate(peers):
            print(f"celery {pool} ×{concurrency}, backlog={backlog}, run {repeat + 1}…", flush=True)
            peer_runs[n].append(celery(amqp_url, work, arguments.events, pool, concurrency, backlog=backlog))
    report["bare_loop"] = median_of(bare_runs)
    report["bare_loop_live"] = median_of(bare_live_runs)
    report["throughput"] = [median_of(rows) for (version, _), rows in runs.items() if version == "this"]
    if "before" in compared:
        report["throughput_before"] = [
            median_of(rows) for (version, _), rows in runs.items() if version == "before"
        ]
    report["celery"] = [median_of(rows) for rows in peer_runs.values()]
    # Latency on a system that is not saturated: half the rate 2 dispatchers sustained while
    # events were published.
    live = next(r for r in report["throughput"] if r["dispatchers"] == 2 and r["mode"] == "live")
    half_rate = int(live["deliveries_per_s"] / 2)
    print(f"latency at {half_rate}/s…", flush=True)
    report["latency"] = await latency(compared["this"], work, half_rate, arguments.latency_s, 10)
    if "before" in compared:
        print(f"latency at {half_rate}/s (before)…", flush=True)
        report["latency_before"] = await latency(compared["before"], work, half_rate, arguments.latency_s, 10)


#: ``--smoke``: every step of make bench, small (a step that fails shows in minutes, not after 40).
SMOKE: dict[str, Any] = {
    "events": 1000, "repeat": 1, "latency_s": 5, "client_requests": 2000, "monitor_records": 20_000,
    "monitor_dead_letters": 100, "delivery_log_attempts": 20_000, "outbox_rows": 1000, "slow_endpoints": 10,
    "slow_beside": 10, "soak_s": 30, "soak_rate": 50, "burst": 1000,
}  # fmt: skip


async def main(arguments: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
    }
    before = versions.hookline_of(arguments.before) if arguments.before else None
    with vhost(arguments.amqp_url) as amqp_url, contextlib.ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="hookline-bench-"))
        print(f"logs in {work}", flush=True)
        if not arguments.quick:
            print("clients…", flush=True)
            report["clients"] = clients(work, arguments.client_requests, 32)
        services = Services(amqp_url, work)
        # The version before, if asked for: its own vhost and ingest, each of its runs beside this one's.
        compared = {"this": services}
        if before is not None:
            report["before"] = {"ref": arguments.before, "commit": versions.commit_of(arguments.before)}
            before_url = stack.enter_context(vhost(arguments.amqp_url))
            compared["before"] = Services(before_url, work, binary=before)
        for each in compared.values():
            each.start_ingest()
        try:
            await delivery_rates(arguments, report, amqp_url, work, compared)
            if arguments.quick:
                return report
            print("delay accuracy…", flush=True)
            report["delays"] = await delay_accuracy(amqp_url)
            print("memory with 1,000 endpoints…", flush=True)
            limit = broker_file_limit()
            if limit is not None and limit < 1200:
                # RabbitMQ 3.x blocks new connections once quorum queues have used up its file handles.
                reason = (
                    f"the broker allows {limit} open files; 1,000 endpoints need more (README, Operations)"
                )
                print(f"skipped: {reason}", flush=True)
                report["memory"] = {"skipped": reason}
            else:
                report["memory"] = await memory(services, work, 1000)
        finally:
            for each in compared.values():
                each.stop_all()
    from bench import slow_endpoints

    # After the other vhost is gone: 220 endpoint queues need most of a stock broker's 927 file handles.
    print(
        f"{arguments.slow_endpoints} slow endpoints beside {arguments.slow_beside} healthy ones…", flush=True
    )
    # A thread: measure() runs each case in an event loop of its own (asyncio.run, which refuses to
    # start inside this one).
    report["slow_endpoints"] = await asyncio.to_thread(
        slow_endpoints.measure,
        argparse.Namespace(
            amqp_url=arguments.amqp_url, slow=arguments.slow_endpoints, healthy=arguments.slow_beside,
            events=50, rate_per_s=2.0, slow_ms=8000, dispatchers=2, wait_s=120.0, alone_too=True,
        ),
    )  # fmt: skip
    from bench import burst

    print(f"a burst of {arguments.burst:,} to one endpoint, beside a trickle to two others…", flush=True)
    with vhost(arguments.amqp_url) as burst_url:
        report["burst"] = await burst.run(
            burst_url, count=arguments.burst, trickle_per_s=20.0, dispatchers=2, settings={}
        )
    from bench import polling

    print(f"a polling endpoint fetching {arguments.polling_events:,} events…", flush=True)
    with vhost(arguments.amqp_url) as polling_url:
        report["polling"] = await polling.run(
            polling_url, count=arguments.polling_events, limit=250, other_types=0
        )
    from bench import filters

    print("endpoint filters where events are fanned out…", flush=True)
    report["filters"] = filters.run(events=2000)
    from bench import monitor_restart

    print(f"monitor restart with {arguments.monitor_records:,} telemetry records…", flush=True)
    with vhost(arguments.amqp_url) as monitor_url:
        report["monitor_restart"] = await monitor_restart.measure(
            monitor_url, work, arguments.monitor_records, arguments.monitor_dead_letters
        )
    from bench import monitor_soak

    print(f"monitor soak, {arguments.soak_s / 60:.0f} min at {arguments.soak_rate:.0f} events/s…", flush=True)
    with vhost(arguments.amqp_url) as soak_url:
        report["monitor_soak"] = await monitor_soak.measure(
            soak_url, work, duration_s=arguments.soak_s, rate=arguments.soak_rate
        )
    from bench import delivery_log

    print(f"delivery log with {arguments.delivery_log_attempts:,} attempts…", flush=True)
    report["delivery_log"] = await delivery_log.main(arguments.delivery_log_attempts, runs=300)
    from bench import outbox

    print(f"outbox relay with {arguments.outbox_rows:,} rows, beside the direct publish path…", flush=True)
    try:
        with vhost(arguments.amqp_url) as outbox_url:
            report["outbox"] = await outbox.measure(
                outbox_url, arguments.postgres_url, arguments.outbox_rows, work
            )
    except outbox.psycopg.OperationalError as exc:
        report["outbox"] = {"skipped": f"no PostgreSQL at --postgres-url ({str(exc).strip()[:200]})"}
    return report


def broker_file_limit() -> int | None:
    done = subprocess.run(
        ["rabbitmq-diagnostics", "-q", "status", "--formatter", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return int(json.loads(done.stdout)["file_descriptors"]["total_limit"])
    except (ValueError, KeyError, TypeError):
        return None


def machine() -> dict[str, Any]:
    rabbit = subprocess.run(
        ["rabbitmqctl", "-q", "version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {"cpus": os.cpu_count(), "python": sys.version.split()[0], "rabbitmq": rabbit}


def rate_rows(report: dict[str, Any], bare: float) -> list[str]:
    """Deliveries/s of every configuration and of the peer, against the bare loop and each other."""
    lines: list[str] = []

    def runs(row: dict[str, Any]) -> str:
        return f"median of {', '.join(f'{r:,}' for r in row['runs_per_s'])}"

    bare_live = report.get("bare_loop_live", {}).get("deliveries_per_s")

    def against(row: dict[str, Any]) -> str:
        """The ratio to the bare loop, and for a live run to the bare loop consuming while published."""
        rate = row["deliveries_per_s"]
        live = row["mode"].startswith("live") and bare_live
        return f"{rate / bare:.2f}" + (f" ({rate / bare_live:.2f} of the live loop)" if live else "")

    before = report.get("before", {}).get("ref")
    for n, row in enumerate(report["throughput"]):
        rate = row["deliveries_per_s"]
        lines.append(
            f"| hookline, {row['dispatchers']} dispatcher(s), {row['events']:,} events, {row['mode']} "
            f"| {rate:,.0f} deliveries/s ({runs(row)}) | {against(row)} |"
        )
        if before:
            then = report["throughput_before"][n]
            lines.append(
                f"| ↳ the same, hookline as of {before} | {then['deliveries_per_s']:,.0f} deliveries/s "
                f"({runs(then)}; this version {rate / then['deliveries_per_s']:.2f}× of it) | {against(then)} |"
            )
    for row in report["celery"]:
        rate = row["deliveries_per_s"]
        lines.append(
            f"| Celery, {row['pool']} ×{row['concurrency']}, {row['events']:,} events, {row['mode']} "
            f"| {rate:,.0f} deliveries/s ({runs(row)}) | {against(row)} |"
        )
    healthy = next(r for r in report["throughput"] if r["mode"] == "backlog" and r["dispatchers"] == 2)
    for row in report["throughput"]:
        if row["mode"].startswith("backlog,") and row["dispatchers"] == 2:
            lines.append(
                f"| ↳ {row['mode'].removeprefix('backlog, ')} vs the same without | "
                f"{row['deliveries_per_s'] / healthy['deliveries_per_s']:.2f} | |"
            )
    for mode in ("backlog", "live"):
        best = max(
            (r for r in report["throughput"] if r["mode"] == mode), key=lambda r: r["deliveries_per_s"]
        )
        for peer in (r for r in report["celery"] if r["mode"] == mode):
            lines.append(
                f"| hookline ({best['dispatchers']} dispatchers, {mode}) vs Celery {peer['pool']} ({mode}) | "
                f"{best['deliveries_per_s'] / peer['deliveries_per_s']:.1f}× | |"
            )
    return lines


def latency_rows(report: dict[str, Any]) -> list[str]:
    """The publish→delivery latency, and the version before's at the same rate when it ran."""
    lines: list[str] = []
    for key, whose in (
        ("latency", ""),
        ("latency_before", f", hookline as of {report.get('before', {}).get('ref')}"),
    ):
        if key not in report:
            continue
        lat = report[key]
        lines.append(
            f"| publish→delivery latency at {lat['offered_per_s']}/s offered, 2 dispatchers{whose} | p50 "
            f"{lat['p50_ms']:.1f} ms, p95 {lat['p95_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms "
            f"({lat['delivered']:,}/{lat['events']:,}) | |"
        )
    return lines


def markdown(report: dict[str, Any]) -> str:
    bare = report["bare_loop"]["deliveries_per_s"]
    lines = [
        f"Run {report['started_at']} on {report['machine']['cpus']} CPUs, RabbitMQ {report['machine']['rabbitmq']}, "
        f"Python {report['machine']['python']}.",
        "",
        "| what | result | vs bare loop |",
        "|---|---|---|",
        f"| bare consume→sign→POST→ack loop (1 process) | {bare:,.0f} deliveries/s | 1.00 |",
    ]
    if "bare_loop_live" in report:
        live = report["bare_loop_live"]["deliveries_per_s"]
        lines.append(
            f"| the same loop consuming while another process fills its queue (confirms, 500 in flight) "
            f"| {live:,.0f} deliveries/s | {live / bare:.2f} |"
        )
    lines += rate_rows(report, bare)
    lines += latency_rows(report)
    mem = report.get("memory", {"skipped": "--quick"})
    if "skipped" in mem:
        lines.append(f"| dispatcher RSS with 1,000 endpoints | skipped: {mem['skipped']} | |")
    else:
        lines.append(
            f"| dispatcher RSS, {mem['endpoints']:,} endpoints | {mem['dispatcher_rss_idle_mib']:.0f} MiB idle, "
            f"{mem['dispatcher_rss_after_traffic_mib']:.0f} MiB after traffic to all | |"
        )
    isolation = report.get("slow_endpoints")
    if isolation:
        alone, beside = isolation["alone"], isolation["beside_slow"]
        lines.append(
            f"| {beside['healthy_endpoints']} healthy endpoints beside {beside['slow_endpoints']} answering after "
            f"{beside['slow_ms'] / 1000:g} s, {beside['events']} events at {beside['events_per_s']:g}/s | "
            f"{beside['healthy_delivered']:,}/{beside['healthy_expected']:,} in {beside['healthy_all_delivered_s']} s, "
            f"p50 {beside['healthy_p50_ms']:.0f} ms, p99 {beside['healthy_p99_ms']:.0f} ms (alone: p50 "
            f"{alone['healthy_p50_ms']:.0f} ms, p99 {alone['healthy_p99_ms']:.0f} ms); failed attempts "
            f"{beside['healthy_failed_attempts']}, breakers moved {beside['healthy_breakers_changed']} | |"
        )
    # The cases whose module writes its own row.
    cases = [case for case in ("burst", "polling", "filters") if report.get(case)]
    lines += [
        row for case in cases for row in importlib.import_module(f"bench.{case}").markdown(report[case])
    ]
    restart = report.get("monitor_restart")
    if restart:
        lines.append(
            f"| health monitor with {restart['telemetry_records']:,} telemetry records and "
            f"{restart['dead_letters']:,} dead letters: ready after | rebuilt from the streams "
            f"{restart['rebuild_ready_s']:.1f} s ({restart['rebuild_rss_mib']:.0f} MiB); restarted "
            f"{restart['restart_ready_s']:.1f} s ({restart['restart_rss_mib']:.0f} MiB); after SIGKILL "
            f"{restart['after_kill_ready_s']:.1f} s ({restart['after_kill_rss_mib']:.0f} MiB) | |"
        )
    soak = report.get("monitor_soak")
    if soak:
        from bench import monitor_soak

        lines += monitor_soak.markdown(soak)
    stored = report.get("delivery_log")
    if stored:
        queries = stored["queries"]
        lines.append(
            f"| delivery log with {stored['attempts']:,} attempts ({stored['disk_mb']:,.0f} MB): p50 / p99 | "
            f"an event's attempts {queries['event_attempts']['p50_ms']} / {queries['event_attempts']['p99_ms']} ms; "
            f"an endpoint's latest 100 {queries['endpoint_attempts_first_page']['p50_ms']} / "
            f"{queries['endpoint_attempts_first_page']['p99_ms']} ms; a tenant's latest 50 events "
            f"{queries['tenant_recent_events']['p50_ms']} / {queries['tenant_recent_events']['p99_ms']} ms | |"
        )
    relayed = report.get("outbox")
    if relayed and "skipped" in relayed:
        lines.append(f"| outbox relay | skipped: {relayed['skipped']} | |")
    elif relayed:
        from bench import outbox

        lines += outbox.markdown(relayed)
    if "clients" not in report:
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "| delivery client (concurrency 32, same receiver) | requests/s | vs aiohttp |",
        "|---|---|---|",
    ]
    fastest = max(row["requests_per_s"] for row in report["clients"])
    for row in report["clients"]:
        lines.append(
            f"| {row['client']} | {row['requests_per_s']:,.0f} | {row['requests_per_s'] / fastest:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--amqp-url", default=os.environ.get("HOOKLINE_AMQP_URL", "amqp://guest:guest@localhost:5672/")
    )
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--latency-s", type=float, default=20.0)
    parser.add_argument("--client-requests", type=int, default=5_000)
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per throughput configuration (median reported)"
    )
    parser.add_argument("--monitor-records", type=int, default=1_000_000)
    parser.add_argument("--monitor-dead-letters", type=int, default=100_000)
    parser.add_argument("--delivery-log-attempts", type=int, default=1_000_000)
    parser.add_argument("--outbox-rows", type=int, default=10_000)
    parser.add_argument("--slow-endpoints", type=int, default=200, help="answering after 8 s")
    parser.add_argument("--slow-beside", type=int, default=20, help="healthy endpoints beside them")
    parser.add_argument(
        "--soak-s", type=float, default=360.0, help="the monitor's soak, in seconds (3600: the hour)"
    )
    parser.add_argument("--soak-rate", type=float, default=300.0, help="the monitor's soak, events/s")
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "HOOKLINE_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
        ),
        help="a PostgreSQL user that may create databases (the outbox relay's benchmark)",
    )
    parser.add_argument(
        "--burst", type=int, default=10_000, help="events published at once to one endpoint (bench/burst.py)"
    )
    parser.add_argument(
        "--polling-events",
        type=int,
        default=10_000,
        help="events a polling endpoint fetches (bench/polling.py)",
    )
    parser.add_argument(
        "--before",
        metavar="REF",
        help="also run hookline as of this git commit (installed once into bench/.versions/), each of "
        "its delivery-rate runs and its latency beside this version's, in a vhost of its own",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the delivery rates (bare loop, hookline, Celery) and the latency",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every step with tiny sizes (about 5 minutes): that make bench runs end to end, not its numbers",
    )
    arguments = parser.parse_args()
    if arguments.smoke:
        for name, value in SMOKE.items():
            setattr(arguments, name, value)
    report = uvloop.run(main(arguments))
    RESULTS.mkdir(exist_ok=True)
    name = "smoke" if arguments.smoke else "latest"  # a smoke run's numbers never pass for a bench's
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)
