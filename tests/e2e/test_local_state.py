"""Local state, with the real services. It never stops a service: every SQLite file the ingest and the
monitor keep is overwritten with garbage (one truncated instead) while they are stopped; started again
on their ports, they set each file aside, say so once, count it, are ready, and answer from views
rebuilt from the streams with what they answered before. And a restart does not repeat itself: the
monitor's alert book is kept with its checkpoint, so a restarted monitor tells nothing twice and still
resolves what ended while it was down."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import services
from support.monitoring import set_status
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

SYSTEM_ENV = {
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "3",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
}
AUTH = {"authorization": f"Bearer {services.TOKEN}"}


async def get(service: services.Service, path: str, **params: str) -> Any:
    async with httpx.AsyncClient(base_url=service.base_url, headers=AUTH, timeout=30) as client:
        response = await client.get(path, params=params)
    return response.json() if response.status_code == 200 else None


def log_lines(service: services.Service, event: str) -> list[dict[str, Any]]:
    lines = (json.loads(line) for line in service.log().splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == event]


async def set_aside_counted(service: services.Service) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=service.base_url, headers=AUTH, timeout=30) as client:
        text = (await client.get("/metrics")).text
    return {
        sample.labels["file"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "hookline_state_files_set_aside_total"
    }


def state_files(system: System, service: services.Service, prefix: str) -> list[Path]:
    return sorted(Path(system.env["HOOKLINE_STATE_DIR"]).glob(f"{prefix}-{service.port}*.sqlite"))


def damage(files: list[Path]) -> Path:
    """Garbage over every file but the attempts, which is truncated to half; returns that one."""
    truncated = next(path for path in files if path.name.endswith(".attempts.sqlite"))
    for path in files:
        if path == truncated:
            os.truncate(path, path.stat().st_size // 2)
        else:
            path.write_bytes(os.urandom(path.stat().st_size))
    return truncated


def check_said(said: list[dict[str, Any]], files: list[Path], truncated: Path) -> None:
    """One alert line per file, naming it, where it went and what SQLite said."""
    assert sorted(line["path"] for line in said) == sorted(str(path) for path in files), "each once"
    for line in said:
        assert line["level"] == "error"
        assert line["alert"] is True
        damage = (
            "database disk image is malformed" if line["path"] == str(truncated) else "file is not a database"
        )
        assert line["error"] == damage
        moved = Path(line["moved_to"])
        assert moved.exists()
        assert moved.name.startswith(Path(line["path"]).name + ".corrupt-")


async def test_garbage_over_every_local_file_costs_a_rebuild_not_the_service(
    system: System, receiver: Receiver
) -> None:
    def respond(request: Received) -> Reply:
        return Reply(status=400 if request.path == "/refuses" else 204)

    receiver.responder = respond
    acme = tenant()
    ok = system.add_endpoint(acme, receiver.url("/ok"), ["#"])
    refuses = system.add_endpoint(acme, receiver.url("/refuses"), ["#"])
    with system.api() as api:
        published = api.post("/v1/events", json={"tenant": acme, "type": "order.created", "data": {}})
    assert published.status_code == 202, published.text
    event_id = published.json()["id"]

    async def answers() -> dict[str, Any] | None:
        """What the ingest and the monitor answer from their views, once every view has it all."""
        found = {
            "story": await get(system.ingest, f"/v1/events/{event_id}"),
            "dead_letters": await get(system.ingest, "/v1/dead-letters", tenant=acme),
            "audit": await get(system.ingest, "/v1/audit", tenant=acme),
            "health": await get(system.monitor, f"/v1/endpoints/{ok['id']}/health"),
            "analysis": await get(system.monitor, "/v1/dead-letters/analysis", tenant=acme),
        }
        if any(value is None for value in found.values()):
            return None
        states = {course["endpoint_id"]: course["state"] for course in found["story"]["endpoints"]}
        complete = (
            states == {ok["id"]: "delivered", refuses["id"]: "dead"}
            and len(found["dead_letters"]["data"]) == 1
            and len(found["audit"]["data"]) == 2
            and found["health"]["samples"] == 1
            and len(found["analysis"]) == 1
        )
        return found if complete else None

    before = await eventually(answers, timeout_s=30)

    assert system.ingest.stop() == 0
    assert system.monitor.stop() == 0
    for dispatcher in system.dispatchers:
        assert dispatcher.stop() == 0
    files = state_files(system, system.ingest, "ingest") + state_files(
        system, system.monitor, "health-monitor"
    )
    names = [path.name.split("-", 2)[-1] if path.name.startswith("health") else path.name for path in files]
    # dead letters, events, attempts, audit, registry; dead letters, checkpoint, registry
    assert len(files) == 8, names
    registries = [path for d in system.dispatchers for path in state_files(system, d, "dispatcher")]
    assert len(registries) == 2, "a registry per dispatcher"
    files += registries
    truncated = damage(files)

    system.ingest = system.start_again(system.ingest)  # ready: wait_ready
    system.monitor = system.start_again(system.monitor)
    system.dispatchers = [system.start_again(d) for d in system.dispatchers]
    after = await eventually(answers, timeout_s=60)
    assert after["story"]["endpoints"] == before["story"]["endpoints"]
    assert after["dead_letters"] == before["dead_letters"]
    assert after["audit"] == before["audit"]
    for key in ("samples", "p50_ms", "p95_ms", "success_rate", "breaker_state"):
        assert after["health"][key] == before["health"][key], key
    assert after["analysis"] == before["analysis"]

    said = log_lines(system.ingest, "state_file_set_aside") + log_lines(
        system.monitor, "state_file_set_aside"
    )
    services_files = [path for path in files if path not in registries]
    check_said(said, services_files, truncated)
    check_said(
        [line for d in system.dispatchers for line in log_lines(d, "state_file_set_aside")],
        registries,
        truncated,
    )
    counted = await set_aside_counted(system.ingest) | await set_aside_counted(system.monitor)
    assert counted == {path.name: 1.0 for path in services_files}

    # The registries rebuilt from the change log: the next event reaches the endpoint.
    with system.api() as api:
        again = api.post("/v1/events", json={"tenant": acme, "type": "order.created", "data": {}})
    assert again.status_code == 202, again.text

    async def delivered_again() -> bool:
        return any(
            r.headers["webhook-id"] == again.json()["id"] for r in receiver.requests if r.path == "/ok"
        )

    await eventually(delivered_again, timeout_s=30)


@asynccontextmanager
async def alerts_heard(amqp_url: str) -> AsyncIterator[list[dict[str, Any]]]:
    """Every message on the ``alerts`` exchange while inside, once each (by message id), in order."""
    heard: list[dict[str, Any]] = []
    seen: set[str | None] = set()
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind("alerts", routing_key="#")

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            if message.message_id not in seen:
                seen.add(message.message_id)
                heard.append(json.loads(message.body))
            await message.ack()

        await queue.consume(on_message)
        yield heard


def told(heard: list[dict[str, Any]], endpoint_id: str) -> list[tuple[str, str]]:
    """What the alerts exchange said of the endpoint's breaker and status (its dead letters aside)."""
    return [
        (body["alert"], body["state"])
        for body in heard
        if body["endpoint_id"] == endpoint_id and body["alert"] in {"breaker_open", "endpoint_disabled"}
    ]


def notified(receiver: Receiver, endpoint_id: str) -> list[str]:
    """The notifications of ``endpoint_id``'s tenant about it, once each (by webhook id), in order."""
    kinds: dict[str, str] = {}
    for request in receiver.requests:
        if request.path == "/notify":
            event = json.loads(request.body)
            if event["data"]["endpoint_id"] == endpoint_id:
                kinds.setdefault(request.headers["webhook-id"], event["type"])
    return list(kinds.values())


async def test_a_restarted_monitor_tells_nothing_twice_and_resolves_what_ended_meanwhile(
    system: System, receiver: Receiver
) -> None:
    status = {"/broken": 503, "/gone": 410, "/later": 503, "/notify": 204}
    receiver.responder = lambda request: Reply(status=status[request.path])
    acme = tenant()
    broken = system.add_endpoint(acme, receiver.url("/broken"), ["a.*"], notify_url=receiver.url("/notify"))
    gone = system.add_endpoint(acme, receiver.url("/gone"), ["b.*"])
    async with alerts_heard(system.amqp_url) as heard:
        with system.api() as api:
            for event_type in ("a.x", "a.x", "a.x", "a.x", "b.x"):
                answer = api.post("/v1/events", json={"tenant": acme, "type": event_type, "data": {}})
                assert answer.status_code == 202, answer.text

        async def both_firing() -> bool:
            return (
                told(heard, broken["id"]) == [("breaker_open", "firing")]
                and told(heard, gone["id"]) == [("endpoint_disabled", "firing")]
                and notified(receiver, broken["id"]) == ["endpoint.failing"]
            )

        await eventually(
            both_firing, timeout_s=40, explain=lambda: f"{heard} {notified(receiver, broken['id'])}"
        )

        # Down for a while; meanwhile the disabled endpoint is resumed (the 410 endpoint gets no event).
        assert system.monitor.stop() == 0
        await set_status(system, gone["id"], "resume")
        system.monitor = await asyncio.to_thread(system.start_again, system.monitor)

        async def resolved() -> bool:
            return told(heard, gone["id"]) == [
                ("endpoint_disabled", "firing"),
                ("endpoint_disabled", "resolved"),
            ]

        await eventually(resolved, timeout_s=30, explain=lambda: str(heard))
        # The sentinel: an alert and a notification that fire after the restart, heard after anything the
        # restart would have repeated.
        later = system.add_endpoint(acme, receiver.url("/later"), ["c.*"], notify_url=receiver.url("/notify"))
        with system.api() as api:
            for _ in range(4):
                answer = api.post("/v1/events", json={"tenant": acme, "type": "c.x", "data": {}})
                assert answer.status_code == 202, answer.text

        async def sentinel() -> bool:
            return told(heard, later["id"]) == [("breaker_open", "firing")] and notified(
                receiver, later["id"]
            ) == ["endpoint.failing"]

        await eventually(sentinel, timeout_s=40, explain=lambda: str(heard))
    assert told(heard, broken["id"]) == [("breaker_open", "firing")], "not told again"
    assert notified(receiver, broken["id"]) == ["endpoint.failing"], "its tenant not told again"
    assert told(heard, gone["id"]) == [("endpoint_disabled", "firing"), ("endpoint_disabled", "resolved")]
    assert log_lines(system.monitor, "alert_book_restored")[0]["firing"] >= 2
