"""The broker running out of memory, disk or file handles, with the real services and real alarms.

``rabbitmqctl set_vm_memory_high_watermark`` and ``set_disk_free_limit`` raise the broker's own alarms,
which block the publishers of every vhost (each test keeps them short; the helper always clears them).
The monitor reads the broker's alarms, disk and file handles through ``rabbitmq-diagnostics`` where the
broker runs on this machine (as in CI); elsewhere only its blocked connection tells it of an alarm.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import httpx
import pytest
from aio_pika.abc import AbstractIncomingMessage
from support import services
from support.broker import Broker
from support.monitoring import AUTH, get_json, publish
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.serial, pytest.mark.timeout(240)]

SYSTEM_ENV = {
    "HOOKLINE_RABBITMQ_DIAGNOSTICS": "rabbitmq-diagnostics",
    "HOOKLINE_BROKER_POLL_S": "2",  # each reading boots rabbitmq-diagnostics: half a second of CPU
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "1000",  # the flaky endpoint is retried, never broken
}


class Endpoints:
    """``/steady`` answers 204 after 0.1 s; ``/flaky`` answers 500 while ``failing``. Both record the
    event ids they accepted."""

    def __init__(self, receiver: Receiver) -> None:
        self.failing = True
        self.accepted: dict[str, set[str]] = {"/steady": set(), "/flaky": set()}
        self.attempts: dict[str, int] = {"/steady": 0, "/flaky": 0}
        receiver.responder = self._respond

    def _respond(self, request: Received) -> Reply:
        self.attempts[request.path] += 1
        if request.path == "/flaky" and self.failing:
            return Reply(status=500)
        self.accepted[request.path].add(request.headers["webhook-id"])
        return Reply(status=204, delay_s=0.1 if request.path == "/steady" else 0.0)

    async def wait_accepted(self, path: str, ids: set[str], timeout_s: float = 60) -> None:
        async def there() -> bool:
            return ids <= self.accepted[path]

        await eventually(there, timeout_s=timeout_s, every_s=0.1)


@pytest.fixture
async def alerts_heard(system: System) -> AsyncIterator[list[dict[str, Any]]]:
    """Every message the monitor publishes on the ``alerts`` exchange, as a subscriber would see them."""
    heard: list[dict[str, Any]] = []
    connection = await aio_pika.connect(system.amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind("alerts", routing_key="#")

        async def on_message(message: AbstractIncomingMessage) -> None:
            heard.append(json.loads(message.body))
            await message.ack()

        await queue.consume(on_message)
        yield heard


async def readable(system: System) -> bool:
    """The monitor reads the broker's own numbers (the CLI is here and the broker is local)."""
    summary = await get_json(system.monitor, "/v1/status")
    assert summary is not None
    return summary["broker"]["capacity"] is not None


async def firing(service: services.Service) -> set[str]:
    return {alert["alert"] for alert in await get_json(service, "/v1/alerts") or []}


async def post(service: services.Service, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=service.base_url, headers=AUTH, timeout=30) as client:
        return await client.post(path, json=body)


async def readyz(service: services.Service) -> httpx.Response:
    async with httpx.AsyncClient(base_url=service.base_url, timeout=10) as client:
        return await client.get("/readyz")


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def metrics(service: services.Service) -> str:
    # The API token: the monitor's /metrics needs a token (a dispatcher's is open without one).
    async with httpx.AsyncClient(base_url=service.base_url, headers=AUTH, timeout=10) as client:
        response = await client.get("/metrics")
    assert response.status_code == 200, f"{service.name}: {response.status_code} {response.text[:200]}"
    return response.text


async def test_a_memory_alarm_is_alerted_refused_at_the_door_and_loses_nothing(
    system: System, receiver: Receiver, rabbitmq: Broker, alerts_heard: list[dict[str, Any]]
) -> None:
    acme = tenant()
    endpoints = Endpoints(receiver)
    # One delivery at a time, 0.1 s each: the backlog is still being delivered when the alarm comes.
    system.add_endpoint(acme, receiver.url("/steady"), ["steady.*"], max_in_flight=1)
    system.add_endpoint(acme, receiver.url("/flaky"), ["flaky.*"])
    assert await readable(system), "CI runs the broker on this machine, with its CLI"
    expected_alert = "broker_memory_alarm"

    steady = set(await publish(system, acme, "steady.x", [f"evt_steady_{n}" for n in range(60)]))
    flaky = set(await publish(system, acme, "flaky.x", [f"evt_flaky_{n}" for n in range(5)]))
    await eventually(lambda: _true(endpoints.attempts["/flaky"] >= 5 and endpoints.accepted["/steady"]))

    async with rabbitmq.alarm("memory"):
        # The ingest stops taking events, and says so to its load balancer, within a second or two.
        async def ingest_unready() -> httpx.Response | None:
            response = await readyz(system.ingest)
            return response if response.status_code == 503 else None

        unready = await eventually(ingest_unready, timeout_s=15)
        assert "refusing publishes" in unready.json()["message"]
        flaky_attempts = endpoints.attempts["/flaky"]
        refused = await post(system.ingest, "/v1/events", {"tenant": acme, "type": "steady.x", "data": {}})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == "broker_unavailable"
        # Refused at once for the alarm, not after the publish deadline ("the broker did not confirm it").
        assert "refuses publishes" in refused.json()["message"], refused.text
        assert int(refused.headers["retry-after"]) > 0
        created = await post(
            system.ingest,
            "/v1/endpoints",
            {"tenant": acme, "url": receiver.url("/new"), "event_types": ["#"]},
        )
        assert (created.status_code, created.json()["error"]) == (503, "broker_unavailable")

        # The dispatchers stay ready and go on delivering (acks are not publishes): the whole backlog.
        for dispatcher in system.dispatchers:
            assert (await readyz(dispatcher)).status_code == 200
        await endpoints.wait_accepted("/steady", steady)

        # The operator hears of it: the monitor's API and metrics (the alerts exchange has to wait).
        await eventually(lambda: _has(firing(system.monitor), expected_alert), timeout_s=15)
        assert metric(await metrics(system.monitor), "hookline_broker_memory_alarm") == 1.0
        dropped = [
            metric(await metrics(d), "hookline_telemetry_dropped_records_total") for d in system.dispatchers
        ]
        assert any(count and count > 0 for count in dropped), f"telemetry dropped, and counted: {dropped}"
        assert not endpoints.accepted["/flaky"]
        # A failed attempt's retry cannot be published: the message is held, not handed back and tried
        # again in a loop (each event at most once more, coming back from the delay queues).
        assert endpoints.attempts["/flaky"] - flaky_attempts <= 2 * len(flaky)
        endpoints.failing = False  # fixed meanwhile; its retries wait for the broker to take them

    # Everything resumes by itself.
    await eventually(lambda: _status(readyz(system.ingest), 200), timeout_s=15)
    after = await post(system.ingest, "/v1/events", {"tenant": acme, "type": "steady.x", "data": {}})
    assert after.status_code == 202, after.text
    steady.add(after.json()["id"])
    await endpoints.wait_accepted("/steady", steady)
    await endpoints.wait_accepted("/flaky", flaky)
    await eventually(lambda: _lacks(firing(system.monitor), expected_alert), timeout_s=15)

    # Subscribers of the alerts exchange get both, in order, once the broker takes publishes again.
    async def told() -> list[str] | None:
        states = [a["state"] for a in alerts_heard if a["alert"] == expected_alert]
        return states if "resolved" in states else None

    assert await eventually(told, timeout_s=15) == ["firing", "resolved"]
    # Counted: every event published was delivered, none dead-lettered.
    delivered = endpoints.accepted["/steady"] | endpoints.accepted["/flaky"]
    assert (steady | flaky) - delivered == set(), "lost"
    summary = await get_json(system.monitor, "/v1/status")
    assert summary["dead_letter"] == 0


async def test_a_disk_alarm_is_alerted_and_the_ingest_refuses_until_it_clears(
    system: System, receiver: Receiver, rabbitmq: Broker
) -> None:
    acme = tenant()
    endpoints = Endpoints(receiver)
    # From a broker taking writes: the previous test's alarm may still be clearing (its unblock reaches
    # each connection in its own time).
    await eventually(lambda: _status(readyz(system.ingest), 200), timeout_s=15)
    system.add_endpoint(acme, receiver.url("/steady"), ["steady.*"])
    async with rabbitmq.alarm("disk"):
        await eventually(lambda: _status(readyz(system.ingest), 503), timeout_s=15)
        refused = await post(system.ingest, "/v1/events", {"tenant": acme, "type": "steady.x", "data": {}})
        assert (refused.status_code, refused.json()["error"]) == (503, "broker_unavailable")
        await eventually(lambda: _has(firing(system.monitor), "broker_disk_alarm"), timeout_s=15)
        summary = await get_json(system.monitor, "/v1/status")
        assert summary["broker"]["capacity"]["disk_alarm"] is True
        env = {**system.env, "HOOKLINE_MONITOR_URL": system.monitor.base_url}
        shown = await asyncio.to_thread(
            subprocess.run, [services.HOOKLINE, "status"], env=env, capture_output=True, text=True, timeout=60
        )
        assert "DISK ALARM ON" in shown.stdout, shown.stdout + shown.stderr
        # Last in the alarm: the ingest's reading of the broker (kept a few seconds) says "alarm".
        no_endpoint = await post(
            system.ingest, "/v1/endpoints", {"tenant": acme, "url": receiver.url("/x"), "event_types": ["#"]}
        )
        assert (no_endpoint.status_code, no_endpoint.json()["error"]) == (503, "broker_unavailable")
    await eventually(lambda: _status(readyz(system.ingest), 200), timeout_s=15)
    # Right away, although the ingest's last reading (likely younger than its 5 s) still says "alarm": with
    # the broker taking its writes, it reads again before refusing.
    system.add_endpoint(acme, receiver.url("/after"), ["after.*"])
    accepted = await post(system.ingest, "/v1/events", {"tenant": acme, "type": "steady.x", "data": {}})
    assert accepted.status_code == 202, accepted.text
    await endpoints.wait_accepted("/steady", {accepted.json()["id"]})
    await eventually(lambda: _lacks(firing(system.monitor), "broker_disk_alarm"), timeout_s=15)


async def test_an_attempt_made_during_an_alarm_is_recorded_once_it_clears(
    system: System, receiver: Receiver, rabbitmq: Broker
) -> None:
    """A resend by hand during an alarm reaches the receiver and is answered at once; its attempt record
    (and the resend's audit record) are held and published when the broker takes publishes again, so the
    delivery log has every attempt made."""
    acme = tenant()
    endpoints = Endpoints(receiver)
    await eventually(lambda: _status(readyz(system.ingest), 200), timeout_s=15)
    endpoint = system.add_endpoint(acme, receiver.url("/steady"), ["steady.*"])
    [event_id] = await publish(system, acme, "steady.x", [f"evt_resent_{acme}"])
    await endpoints.wait_accepted("/steady", {event_id})
    assert await eventually(lambda: _attempt_kinds(system, event_id, ["delivery"]), timeout_s=30)

    async with rabbitmq.alarm("memory"):
        await eventually(lambda: _status(readyz(system.ingest), 503), timeout_s=15)
        sent_before = endpoints.attempts["/steady"]
        resent = await post(system.ingest, f"/v1/events/{event_id}/resend", {"endpoint_id": endpoint["id"]})
        assert resent.status_code == 202, resent.text
        assert (resent.json()["kind"], resent.json()["attempt"]) == ("manual", 2)
        assert endpoints.attempts["/steady"] == sent_before + 1, "attempted during the alarm"
        # Held, and counted: the attempt record and the resend's audit record.
        assert metric(await metrics(system.ingest), "hookline_held_publishes") == 2.0
        # A verification's result could not be written: refused before the receiver is called.
        verify = await post(system.ingest, f"/v1/endpoints/{endpoint['id']}/verify", {})
        assert (verify.status_code, verify.json()["error"]) == (503, "broker_unavailable")
        assert endpoints.attempts["/steady"] == sent_before + 1

    assert await eventually(lambda: _attempt_kinds(system, event_id, ["delivery", "manual"]), timeout_s=30), (
        "the attempt made during the alarm is in the delivery log once it clears"
    )
    page = await get_json(system.ingest, f"/v1/endpoints/{endpoint['id']}/attempts")
    assert [(a["event_id"], a["kind"]) for a in page["data"]] == [
        (event_id, "manual"),
        (event_id, "delivery"),
    ]
    audit = await get_json(system.ingest, "/v1/audit", tenant=acme)
    assert [r["target"] for r in audit["data"] if r["action"] == "event.resent"] == [event_id]
    text = await metrics(system.ingest)
    assert metric(text, "hookline_held_publishes") == 0.0
    assert metric(text, "hookline_held_publishes_dropped_total") == 0.0


async def _attempt_kinds(system: System, event_id: str, kinds: list[str]) -> bool:
    story = await get_json(system.ingest, f"/v1/events/{event_id}")
    if story is None:
        return False
    return [a["kind"] for course in story["endpoints"] for a in course["attempts"]] == kinds


async def test_file_handles_running_out_refuse_queues_of_their_own_and_are_alerted(
    system: System, receiver: Receiver
) -> None:
    """Thresholds set above what the broker has: an endpoint that needs a queue of its own (a cap) is
    refused with the numbers, before anything is declared, while one delivered from its lane costs the
    broker no file handle and is registered; a monitor with a low ratio alerts on handles and queues."""
    acme = tenant()
    tight = services.start(
        "ingest", {**system.env, "HOOKLINE_BROKER_FD_RESERVE": "1000000"}, system.log_dir, name="ingest-tight"
    )
    watchful = services.start(
        "health-monitor",
        {**system.env, "HOOKLINE_BROKER_FD_RATIO": "0.01"},
        system.log_dir,
        name="monitor-watchful",
    )
    system.extra += [tight, watchful]
    await asyncio.to_thread(tight.wait_ready, 60)
    await asyncio.to_thread(watchful.wait_ready, 60)

    before = await get_json(tight, "/v1/endpoints", tenant=acme)
    capped = {"tenant": acme, "url": receiver.url("/x"), "event_types": ["#"], "max_in_flight": 2}
    refused = await post(tight, "/v1/endpoints", capped)
    assert refused.status_code == 503, refused.text
    body = refused.json()
    assert body["error"] == "broker_capacity"
    assert "file handles left" in body["message"]
    assert "HOOKLINE_BROKER_FD_RESERVE" in body["message"]
    assert refused.headers["retry-after"] == "60"
    assert await get_json(tight, "/v1/endpoints", tenant=acme) == before
    plain = await post(tight, "/v1/endpoints", {**capped, "max_in_flight": None, "verify": False})
    assert plain.status_code == 201, plain.text

    # The standby monitor knows what fires (its API says so) even though only the leader publishes.
    await eventually(
        lambda: _has(firing(watchful), "broker_file_handles", "broker_queue_capacity"), timeout_s=20
    )
    text = await metrics(watchful)
    used, limit = (
        metric(text, "hookline_broker_file_descriptors_used"),
        metric(text, "hookline_broker_file_descriptors_limit"),
    )
    assert used is not None
    assert limit is not None
    assert 0 < used < limit
    # The ordinary ingest, with the default reserve, still registers endpoints with a cap.
    system.add_endpoint(acme, receiver.url("/fine"), ["#"], max_in_flight=2)


async def test_queues_of_their_own_are_bounded(system: System, receiver: Receiver) -> None:
    """With HOOKLINE_MAX_ENDPOINT_QUEUES reached, a change that needs a queue of its own is a 503 naming
    the bound; endpoints delivered from their lane are registered as before."""
    acme = tenant()
    bounded = services.start(
        "ingest", {**system.env, "HOOKLINE_MAX_ENDPOINT_QUEUES": "0"}, system.log_dir, name="ingest-bounded"
    )
    system.extra.append(bounded)
    await asyncio.to_thread(bounded.wait_ready, 60)
    endpoint = {"tenant": acme, "url": receiver.url("/b"), "event_types": ["#"], "verify": False}
    refused = await post(bounded, "/v1/endpoints", {**endpoint, "rate_limit_per_s": 5})
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"] == "isolation_capacity"
    assert "HOOKLINE_MAX_ENDPOINT_QUEUES=0" in refused.json()["message"]
    created = await post(bounded, "/v1/endpoints", endpoint)
    assert created.status_code == 201, created.text
    paused = await post(bounded, f"/v1/endpoints/{created.json()['id']}/pause", {})
    assert (paused.status_code, paused.json()["error"]) == (503, "isolation_capacity")


async def _has(alerts: Any, *names: str) -> bool:
    return set(names) <= await alerts


async def _lacks(alerts: Any, name: str) -> bool:
    return name not in await alerts


async def _status(response: Any, status: int) -> bool:
    return bool((await response).status_code == status)


async def _true(value: object) -> bool:
    return bool(value)
