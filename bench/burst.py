"""One endpoint receiving a burst, and the endpoints beside it (issue 24, item 3): tenant ``burst`` has
one endpoint to which B events are published at once; tenant ``neighbour`` shares its lane (a tenant
name chosen to hash to the same lane), tenant ``elsewhere`` is in another lane; each of those two has
an endpoint receiving a steady trickle of events throughout.

Reported for each: deliveries, latency publish → arrival (p50, p99, max) while the burst is on, and for
the burst: how long until the last of its events left the lane (the dispatchers fanned it out: delivered
inline, or handed to the endpoint's queue of its own once it was backlogged), and until the last was
delivered. What the lane's neighbours wait is at most the first of these.

    .venv/bin/python -m bench.burst --burst 10000

Once the burst's endpoint is isolated (backlogged), the leading monitor routes it directly: its queue of
its own bound to ``events``, its lane unbound (health-monitor/direct.py), so the rest of the burst never
passes through the lane; ``burst_routed_directly_s`` says when. ``--direct`` isolates the endpoint
before the burst, as a dispatcher would, and waits until it is routed directly: the whole burst then
goes straight to its queue (the best a burst can cost: one queue write per event). ``--nice-others 10``
runs the ingest and the monitor with ``HOOKLINE_NICE=10``: on this machine's two cores, shared with the
broker and the burst's publisher, they then yield the CPU to the dispatchers.

Each service, the receiving sink and the burst's publisher run in a session of their own, as they would
be deployed (a systemd unit or a container each, a CPU share each): with the kernel's autogroup on, as
here, a session is a CPU share, and all in the bench's they would share one. ``--one-session`` runs them
all in the bench's session. The dispatchers log ``loop_ran_late`` with what held them (lag.py): in every
run measured here, the wait for a CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import aio_pika

from bench.lanes import QUORUM
from bench.run import Services, events_exchange, percentile, start_sink, vhost
from bench.slow_endpoints import log_lines, wait_for
from hookline.shared.broker import placement, topology
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.broker.isolation import Isolation
from hookline.shared.runtime.supervision import Supervisor
from hookline.shared.state import registry

#: Item 3's line for the endpoints beside a burst.
LATE_MS = 250.0


def _same_lane(as_tenant: str, *, other: bool) -> str:
    lane = topology.lane_of(as_tenant)
    for n in range(10_000):
        candidate = f"{'elsewhere' if other else 'neighbour'}-{n}"
        if (topology.lane_of(candidate) == lane) is not other:
            return candidate
    raise RuntimeError("no such tenant name")


def _body(tenant: str, event_id: str, event_type: str) -> bytes:
    return json.dumps(
        {"id": event_id, "type": event_type, "tenant": tenant, "occurred_at": "2026-12-02T00:00:00Z",
         "data": {"x": "a" * 1000}}
    ).encode()  # fmt: skip


async def _publish(
    exchange: aio_pika.abc.AbstractExchange, tenant: str, event_id: str, event_type: str
) -> None:
    await exchange.publish(
        aio_pika.Message(
            _body(tenant, event_id, event_type), content_type="application/json", message_id=event_id,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        ),
        f"{tenant}.{event_type}",
    )  # fmt: skip


async def trickle(
    amqp_url: str, tenants: list[str], stop: asyncio.Event, per_s: float, sent: dict[str, float]
) -> None:
    """``per_s`` events a second to each tenant's trickle endpoint until ``stop``; when each was sent."""
    async with events_exchange(amqp_url) as exchange:
        n = 0
        started = time.monotonic()
        while not stop.is_set():
            for tenant in tenants:
                event_id = f"evt_{tenant}_{n}"
                sent[event_id] = time.time()
                await _publish(exchange, tenant, event_id, "tick.x")
            n += 1
            await asyncio.sleep(max(0.0, started + n / per_s - time.monotonic()))


async def burst(amqp_url: str, count: int) -> dict[str, float]:
    sent: dict[str, float] = {}
    async with events_exchange(amqp_url) as exchange:
        slots = asyncio.Semaphore(500)

        async def one(n: int) -> None:
            async with slots:
                event_id = f"evt_burst_{n}"
                sent[event_id] = time.time()
                await _publish(exchange, "burst", event_id, "burst.x")

        await asyncio.gather(*(one(n) for n in range(count)))
    return sent


async def isolated(amqp_url: str, endpoint_id: str) -> None:
    """The endpoint given a queue of its own as a dispatcher gives one to a backlogged endpoint."""
    supervisor = Supervisor()
    async with Broker(amqp_url, name="bench-burst", connect_timeout_s=30) as broker:
        publisher = Publisher(broker)
        try:
            change_log = await registry.follow(
                broker, publisher, supervisor, registry.EndpointRegistry(), sync_timeout_s=30
            )
            endpoint = change_log.registry.get(endpoint_id)
            assert endpoint is not None
            isolation = Isolation(broker, change_log, max_queues=200, timeout_s=30)
            assert await isolation.isolate(endpoint, placement.Reason.BACKLOGGED.value)
        finally:
            await supervisor.stop()
            await publisher.close()


async def burst_elsewhere(amqp_url: str, count: int, *, own_session: bool, nice: int = 0) -> dict[str, float]:
    """:func:`burst` from a process of its own: 500 publishes in flight in this one would hold the
    trickle's publishes back (their confirms behind the burst's), and count that as hookline's latency.
    ``nice``: the publisher yields the CPU (an upstream on a machine of its own would not take any)."""
    process = await asyncio.create_subprocess_exec(
        "nice", "-n", str(nice), sys.executable, "-m", "bench.burst", "--publish-only", "--amqp-url", amqp_url, "--burst", str(count),
        stdout=asyncio.subprocess.PIPE, start_new_session=own_session,
    )  # fmt: skip
    out, _ = await process.communicate()
    assert process.returncode == 0, "the burst's publisher failed"
    sent: dict[str, float] = json.loads(out)
    return sent


@asynccontextmanager
async def broker_alone(amqp_url: str, tenant: str) -> AsyncIterator[dict[str, float]]:
    """The broker's part of the trickle's latency: a quorum queue of the bench's own, bound to
    ``tenant``'s events beside hookline's lane, consumed on a connection of its own that acks at once;
    yields when each event arrived there."""
    arrivals: dict[str, float] = {}
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=100)
        queue = await channel.declare_queue("bench.burst.beside", durable=True, arguments=QUORUM)
        await queue.bind(topology.EVENTS_EXCHANGE, f"{tenant}.#")

        async def arrived(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            arrivals[message.message_id or ""] = time.time()
            await message.ack()

        await queue.consume(arrived)
        try:
            yield arrivals
        finally:
            await queue.delete(if_unused=False, if_empty=False)


async def lane_emptied(amqp_url: str, lane: str, after: asyncio.Event) -> float:
    """When the lane had nothing ready or unacked left, once ``after`` is set (the burst is published)."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        while True:
            queue = await channel.declare_queue(lane, passive=True)
            result = queue.declaration_result
            if after.is_set() and result.message_count == 0:
                return time.time()
            await asyncio.sleep(0.1)


async def run(
    amqp_url: str,
    *,
    count: int,
    trickle_per_s: float,
    dispatchers: int,
    settings: dict[str, str],
    direct: bool = False,
    nice_others: int = 0,
    publisher_nice: int = 0,
    one_session: bool = False,
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="hookline-burst-"))
    print(f"logs in {work}", flush=True)
    sink = start_sink(work, own_session=not one_session)
    neighbour, elsewhere = _same_lane("burst", other=False), _same_lane("burst", other=True)
    yielding = {"HOOKLINE_NICE": str(nice_others)}
    services = Services(
        amqp_url, work, settings=settings, service_settings={"ingest": yielding, "health-monitor": yielding},
        own_sessions=not one_session,
    )  # fmt: skip
    try:
        services.start_ingest()
        services.start_monitor()
        created: dict[str, str] = {}
        async with services.api() as api:
            for tenant, path, types in (
                ("burst", "/burst", ["burst.*"]),
                (neighbour, "/neighbour", ["tick.*"]),
                (elsewhere, "/elsewhere", ["tick.*"]),
            ):
                response = await api.post(
                    "/v1/endpoints",
                    json={"tenant": tenant, "url": f"http://127.0.0.1:{sink.port}{path}", "event_types": types,
                          "verify": False},
                )  # fmt: skip
                response.raise_for_status()
                created[tenant] = response.json()["id"]
        services.start_dispatchers(dispatchers)
        if direct:
            await isolated(amqp_url, created["burst"])
            for _ in range(300):  # the monitor's log, read until it says so
                if _routed_directly_at(work, created["burst"]) is not None:
                    break
                await asyncio.sleep(0.2)
        async with broker_alone(amqp_url, elsewhere) as beside:
            stop = asyncio.Event()
            trickle_sent: dict[str, float] = {}
            ticking = asyncio.create_task(
                trickle(amqp_url, [neighbour, elsewhere], stop, trickle_per_s, trickle_sent)
            )
            await asyncio.sleep(3)  # the trickle's own latency before the burst
            published = asyncio.Event()
            emptied = asyncio.create_task(lane_emptied(amqp_url, topology.lane_of("burst"), published))
            burst_sent = await burst_elsewhere(
                amqp_url, count, own_session=not one_session, nice=publisher_nice
            )
            # From its first publish: the publisher's process takes about half a second to start, which
            # the times after the burst began (routed directly, off the lane) once counted.
            burst_started = min(burst_sent.values())
            published.set()
            lane_empty_at = await asyncio.wait_for(emptied, 600)
            stop.set()
            await ticking
            await wait_for(sink.count, count + len(trickle_sent), time.monotonic() + 600)
        await asyncio.sleep(2)
    finally:
        services.stop_all()
        arrivals = sink.finish()["arrivals"]

    def latencies(path: str, sent: dict[str, float], *, during: bool) -> list[float]:
        found = []
        for key, at in arrivals.items():
            if not key.startswith(path + " "):
                continue
            event_id = key.split(" ", 1)[1]
            if event_id in sent and (not during or sent[event_id] >= burst_started):
                found.append((at - sent[event_id]) * 1000)
        return found

    result: dict[str, Any] = {
        "burst": count, "trickle_per_s": trickle_per_s, "lanes": topology.LANES, "direct": direct,
        "ingest_and_monitor_nice": nice_others, "publisher_nice": publisher_nice,
        "sessions": "one" if one_session else "one per process",
    }  # fmt: skip
    for path in ("/neighbour", "/elsewhere"):
        result[path.strip("/")] = _summary(latencies(path, trickle_sent, during=True))
        # When (seconds after the burst began) the trickle's events that missed the 250 ms line were sent:
        # in the burst's first second, while it still passes through its lane, or all along.
        result[path.strip("/")]["late_sent_at_s"] = sorted(
            round(trickle_sent[key.split(" ", 1)[1]] - burst_started, 1)
            for key, at in arrivals.items()
            if key.startswith(path + " ")
            and trickle_sent.get(key.split(" ", 1)[1], 0) >= burst_started
            and (at - trickle_sent[key.split(" ", 1)[1]]) * 1000 > LATE_MS
        )
    # The same trickle, taken from the broker by a bare consumer beside hookline: the broker's share.
    result["elsewhere_broker_alone"] = _summary(
        [(at - trickle_sent[e]) * 1000 for e, at in beside.items() if trickle_sent.get(e, 0) >= burst_started]
    )
    burst_arrivals = [at for key, at in arrivals.items() if key.startswith("/burst ")]
    lines = log_lines(work, "dispatcher")
    handed = [r for r in lines if r.get("event") == "endpoint_isolated"]
    result["burst_delivered"] = len(burst_arrivals)
    result["burst_published_s"] = round(max(burst_sent.values()) - burst_started, 2)
    result["burst_all_delivered_s"] = (
        round(max(burst_arrivals) - burst_started, 2) if burst_arrivals else None
    )
    result["burst_off_the_lane_s"] = round(lane_empty_at - burst_started, 2)
    result["burst_endpoint_isolated"] = [r.get("reason") for r in handed]
    routed_at = _routed_directly_at(work, created["burst"])
    result["burst_routed_directly_s"] = round(routed_at - burst_started, 2) if routed_at is not None else None
    return result


def _routed_directly_at(work: Path, endpoint_id: str) -> float | None:
    """When the monitor logged the endpoint routed directly (None: it did not)."""
    for line in log_lines(work, "health-monitor"):
        if line.get("event") == "endpoint_routed_directly" and line.get("endpoint_id") == endpoint_id:
            return datetime.fromisoformat(line["ts"]).timestamp()
    return None


def _summary(latencies_ms: list[float]) -> dict[str, Any]:
    return {
        "delivered": len(latencies_ms),
        "p50_ms": round(percentile(latencies_ms, 0.5), 1),
        "p99_ms": round(percentile(latencies_ms, 0.99), 1),
        "max_ms": round(max(latencies_ms, default=0.0), 1),
    }


def markdown(result: dict[str, Any]) -> list[str]:
    """make bench's row for a result of :func:`run`."""
    other, neighbour = result["elsewhere"], result["neighbour"]
    return [
        f"| a burst of {result['burst']:,} events to one endpoint, a trickle of {result['trickle_per_s']:g}/s "
        f"to a tenant in another lane and to one in its lane ({result['lanes']} lanes) | other lane p50 "
        f"{other['p50_ms']:.0f} ms, **p99 {other['p99_ms']:.0f} ms** (the broker alone: p99 "
        f"{result['elsewhere_broker_alone']['p99_ms']:.0f} ms); the lane's neighbours p50 "
        f"{neighbour['p50_ms']:.0f} ms, p99 {neighbour['p99_ms']:.0f} ms; routed directly "
        f"{result['burst_routed_directly_s']} s after the first publish, published in "
        f"{result['burst_published_s']} s, all delivered after {result['burst_all_delivered_s']} s | |"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--amqp-url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--burst", type=int, default=10_000)
    parser.add_argument("--trickle-per-s", type=float, default=20.0)
    parser.add_argument("--dispatchers", type=int, default=2)
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a HOOKLINE_ setting for the services",
    )
    parser.add_argument(
        "--direct", action="store_true", help="the endpoint routed directly before the burst (see above)"
    )
    parser.add_argument(
        "--nice-others",
        type=int,
        default=0,
        metavar="N",
        help="HOOKLINE_NICE for the ingest and the monitor: they yield the CPU to the dispatchers",
    )
    parser.add_argument(
        "--publisher-nice",
        type=int,
        default=0,
        metavar="N",
        help="the burst's publisher at this niceness: it stands for an upstream on a machine of its own",
    )
    parser.add_argument(
        "--one-session",
        action="store_true",
        help="every process in the bench's session (with autogroup, one CPU share for them all), not each "
        "service, the sink and the burst's publisher in one of its own (as deployed)",
    )
    parser.add_argument("--publish-only", action="store_true", help=argparse.SUPPRESS)  # the burst's process
    arguments = parser.parse_args()
    if arguments.publish_only:
        print(json.dumps(asyncio.run(burst(arguments.amqp_url, arguments.burst))))
        return
    with vhost(arguments.amqp_url) as amqp_url:
        result = asyncio.run(
            run(
                amqp_url,
                count=arguments.burst,
                trickle_per_s=arguments.trickle_per_s,
                dispatchers=arguments.dispatchers,
                settings=dict(setting.split("=", 1) for setting in arguments.setting),
                direct=arguments.direct,
                nice_others=arguments.nice_others,
                publisher_nice=arguments.publisher_nice,
                one_session=arguments.one_session,
            )
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
