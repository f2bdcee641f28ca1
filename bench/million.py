"""A million registered endpoints (issue 24, item 2): T tenants with E endpoints each, written straight
to the change log (as a long-lived installation would have them; the API's own rate is measured apart,
through the batch route), each tenant's pattern bound on its lane as the ingest binds it.

Reported: how long each service took to be ready on its first start (its registry built from the log)
and on a restart (from its file), and its RSS after each; then one event to each of ``--deliver-tenants``
tenants, which must reach every endpoint of theirs (and nothing else); then ``--register`` endpoints
created through ``POST /v1/endpoints/batch`` (500 a request, 4 requests at once) and the rate.

    .venv/bin/python -m bench.million --tenants 50000 --per-tenant 20      # issue 24, item 2: 1,000,000
    .venv/bin/python -m bench.million --tenants 5000 --per-tenant 20       # 100,000
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import aiormq

from bench.endpoint_scale import rss_mib
from bench.registered import broker_status, publish_one_each, queue_count
from bench.run import HOOKLINE, Services, free_port, start_sink, stop, vhost, wait_ready
from bench.slow_endpoints import wait_for
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import EndpointUpserted, SigningSecret, StoredEndpoint
from hookline.shared.outbound.signing import generate_secret
from hookline.shared.state import registry

IN_FLIGHT = 2_000
BATCH = 500
#: A first start builds the registry from the whole log (about 65 µs a record).
READY_WITHIN_S = 1_800


_ID = "ep_" + "Z" * 26
_TENANT = "tplaceholder"


def record(tenant: str, n: int, sink_port: int, secret: str, now: datetime) -> bytes:
    """An endpoint's record as the ingest writes it, from a template: a million pydantic models would
    take the bench longer than the services it measures."""
    body = _template(sink_port, secret, now).replace(_ID.encode(), new_id("ep").encode(), 1)
    return (
        body.replace(b"@CHG@", new_id("chg").encode(), 1)
        .replace(b"@N@", str(n).encode(), 1)
        .replace(_TENANT.encode(), tenant.encode())
    )


@functools.cache
def _template(sink_port: int, secret: str, now: datetime) -> bytes:
    endpoint = StoredEndpoint(
        id=_ID,
        tenant=_TENANT,
        url=f"http://127.0.0.1:{sink_port}/{_TENANT}/e@N@",
        event_types=["order.*"],
        created_at=now,
        updated_at=now,
        secrets=[SigningSecret(value=secret, created_at=now)],
        laned=True,
    )
    return EndpointUpserted(change_id="@CHG@", at=now, endpoint=endpoint).model_dump_json().encode()


async def write_log(
    amqp_url: str, tenants: int, per_tenant: int, sink_port: int, *, prebuilt: Path | None = None
) -> float:
    """Every endpoint's record, confirmed, and each tenant's pattern bound; the seconds it took.
    ``prebuilt``: also a registry file of them, built by the registry's own code as a service builds it
    from the log (the records are the log's first, one channel keeping their order), in a process of its
    own fed as they are published."""
    started = time.perf_counter()
    builder = None
    if prebuilt is not None:
        builder = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.million", "--build", str(prebuilt), "--amqp-url", amqp_url,
            stdin=asyncio.subprocess.PIPE,
        )  # fmt: skip
    async with Broker(amqp_url, name="bench-million", connect_timeout_s=30) as broker:
        await topology.declare(broker, topology.Retention(event_log_max_age_s=3600))
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            exchange = channel.default_exchange
            secret, now = generate_secret(), datetime.now(UTC)
            slots = asyncio.Semaphore(IN_FLIGHT)
            failed: list[BaseException] = []

            async def one(body: bytes) -> None:
                try:
                    message = aio_pika.Message(body, content_type="application/json", delivery_mode=2)
                    await exchange.publish(message, topology.ENDPOINT_LOG)
                except Exception as exc:  # the run is void: stop at once rather than go on failing
                    failed.append(exc)
                finally:
                    slots.release()

            tasks = set()
            for t in range(tenants):
                tenant = f"t{t:06d}"
                for n in range(per_tenant):
                    await slots.acquire()
                    if failed:
                        raise RuntimeError("a record was not written") from failed[0]
                    body = record(tenant, n, sink_port, secret, now)
                    task = asyncio.create_task(one(body))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    if builder is not None:
                        assert builder.stdin is not None
                        builder.stdin.write(body + b"\n")
                        await builder.stdin.drain()
            await asyncio.gather(*tasks)
            if failed:
                raise RuntimeError("a record was not written") from failed[0]
            for t in range(tenants):
                await topology.bind_patterns(channel, f"t{t:06d}", ["order.*"])
    if builder is not None:
        assert builder.stdin is not None
        builder.stdin.close()
        assert await builder.wait() == 0, "the registry file was not built"
    return time.perf_counter() - started


async def build(path: Path, amqp_url: str) -> None:
    """The registry file of the records on stdin, one a line, at offsets 0, 1, 2…"""
    reader = asyncio.StreamReader(limit=2**20)
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with registry.kept_at(path, vhost=amqp_url.rsplit("/", 1)[1]) as built:
        built.open()
        offset = 0
        while line := await reader.readline():
            built.apply(EndpointUpserted.model_validate_json(line))
            built.store.applied(offset)
            offset += 1


class Fleet:
    """The four services on fixed ports, so that a restart finds each one's files."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.ports = {"ingest": free_port(), "health-monitor": free_port(), "dispatcher-0": free_port(),
                      "dispatcher-1": free_port()}  # fmt: skip
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> dict[str, dict[str, float]]:
        """Each service started and waited for in turn; its seconds to ready and its RSS."""
        variables = {"ingest": "HOOKLINE_INGEST_PORT", "health-monitor": "HOOKLINE_MONITOR_PORT"}
        report = {}
        for name, port in self.ports.items():
            command = name.split("-")[0] if name.startswith("dispatcher") else name
            variable = variables.get(name, "HOOKLINE_DISPATCHER_METRICS_PORT")
            started = time.perf_counter()
            log = (self.services.work / f"{name}-{port}.log").open("ab")
            process = subprocess.Popen(
                [HOOKLINE, command], env=self.services.env(**{variable: str(port)}), stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
            self.services.processes.append(process)
            wait_ready(port, process, timeout_s=READY_WITHIN_S)
            ready_s = time.perf_counter() - started
            self.running[name] = process
            report[name] = {"ready_s": round(ready_s, 2), "rss_mib": round(rss_mib(process.pid), 1)}
        self.services.ingest_port = self.ports["ingest"]
        return report

    def rss(self) -> dict[str, float]:
        return {name: round(rss_mib(process.pid), 1) for name, process in self.running.items()}

    def stop(self) -> None:
        for process in self.running.values():
            stop(process)
            self.services.processes.remove(process)
        self.running.clear()


async def register(services: Services, count: int, sink_port: int) -> float:
    """``count`` endpoints through the batch route, 4 requests of BATCH at once; endpoints a second."""
    batches = [
        [{"tenant": f"r{(b * BATCH + n) // 20:06d}", "url": f"http://127.0.0.1:{sink_port}/r/{b}/{n}",
          "event_types": ["order.*"], "verify": False} for n in range(min(BATCH, count - b * BATCH))]
        for b in range((count + BATCH - 1) // BATCH)
    ]  # fmt: skip
    started = time.perf_counter()
    async with services.api() as api:

        async def worker() -> None:
            while batches:
                response = await api.post("/v1/endpoints/batch", json={"endpoints": batches.pop()})
                response.raise_for_status()
                refused = [item for item in response.json()["results"] if item["status"] != 201]
                assert not refused, refused[:3]

        await asyncio.gather(*(worker() for _ in range(4)))
    return count / (time.perf_counter() - started)


def broker_after(before: dict[str, Any], amqp_url: str, endpoints: int) -> dict[str, Any]:
    """The broker's memory per registered endpoint, file handles and queues (None where the broker took
    longer than two minutes to say: it is busy with the deliveries)."""
    try:
        after = broker_status()
        queues: int | None = queue_count(amqp_url.rsplit("/", 1)[-1])
    except subprocess.TimeoutExpired:
        return {
            "broker_memory_per_endpoint_kib": None,
            "broker_file_descriptors": None,
            "broker_queues": None,
        }
    return {
        "broker_memory_per_endpoint_kib": round(
            (after["memory_bytes"] - before["memory_bytes"]) / endpoints / 1024, 3
        ),
        "broker_file_descriptors": after["file_descriptors_used"],
        "broker_queues": queues,
    }


async def run(
    amqp_url: str,
    *,
    tenants: int,
    per_tenant: int,
    deliver_tenants: int,
    registrations: int,
    wait_s: float,
    prebuilt: bool,
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="hookline-million-"))
    sink = start_sink(work)
    services = Services(amqp_url, work, settings={"HOOKLINE_STATE_DIR": str(work / "state")})
    fleet = Fleet(services)
    result: dict[str, Any] = {"tenants": tenants, "endpoints": tenants * per_tenant, "logs": str(work)}
    broker_before = broker_status()
    try:
        built = work / "built.registry.sqlite" if prebuilt else None
        result["log_written_s"] = round(
            await write_log(amqp_url, tenants, per_tenant, sink.port, prebuilt=built), 1
        )
        if built is None:
            result["first_start"] = fleet.start()
            fleet.stop()
        else:  # each service's file, as its first start would have left it
            (work / "state").mkdir(exist_ok=True)
            for name, port in fleet.ports.items():
                service = "dispatcher" if name.startswith("dispatcher") else name
                shutil.copyfile(built, work / "state" / f"{service}-{port}.registry.sqlite")
        result["restart"] = fleet.start()
        expected = min(deliver_tenants, tenants) * per_tenant
        published = time.perf_counter()
        await publish_one_each(amqp_url, min(deliver_tenants, tenants), digits=6)
        await wait_for(sink.count, expected, time.monotonic() + wait_s)
        result["delivered_s"] = round(time.perf_counter() - published, 1)
        result["rss_after_delivery_mib"] = fleet.rss()
        result.update(broker_after(broker_before, amqp_url, result["endpoints"]))
        (work / "result.json").write_text(json.dumps(result, indent=2))  # kept should the cleanup hang
        if registrations:
            result["registered_per_s"] = round(await register(services, registrations, sink.port), 1)
            result["rss_after_registration_mib"] = fleet.rss()
    except aiormq.exceptions.AMQPError as exc:
        result["error"] = repr(exc)
    finally:
        services.stop_all()
        arrivals = sink.finish()["arrivals"]
    result["delivered"] = len(arrivals)
    result["delivered_to_its_tenant"] = sum(
        1 for key in arrivals if key.split(" ")[1] == f"evt_{key.split('/')[1]}"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--amqp-url", default="amqp://guest:guest@localhost:5672/")
    parser.add_argument("--tenants", type=int, default=50_000)
    parser.add_argument("--per-tenant", type=int, default=20)
    parser.add_argument("--deliver-tenants", type=int, default=100, help="tenants that get one event each")
    parser.add_argument(
        "--register", type=int, default=10_000, help="endpoints created through the batch route"
    )
    parser.add_argument("--wait-s", type=float, default=300.0)
    parser.add_argument("--build", type=Path, help=argparse.SUPPRESS)  # the --prebuilt builder's process
    parser.add_argument(
        "--prebuilt", action="store_true",
        help="build the services' registry files in the bench (the registry's own code, from the same "
        "records) instead of by a first start: a first start reads about 1,600 records a second",
    )  # fmt: skip
    args = parser.parse_args()
    if args.build:
        asyncio.run(build(args.build, args.amqp_url))
        return
    with vhost(args.amqp_url) as amqp_url:
        result = asyncio.run(
            run(
                amqp_url, tenants=args.tenants, per_tenant=args.per_tenant, deliver_tenants=args.deliver_tenants,
                registrations=args.register, wait_s=args.wait_s, prebuilt=args.prebuilt,
            )
        )  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
