"""The health monitor with real services: breakers, probes, slow endpoints, alerts, status, restarts;
and (from test_alert_sinks.py) operator alert sinks: an endpoint's breaker opens and closes; the ops
sink (routed to breaker alerts, signed) and the Slack sink (every alert) each get "firing" then
"resolved".

Times are shrunk through settings: 3 consecutive failures open a breaker, the first cooldown is 3 s.
The alert sinks' test restarts the module's monitor with sinks of its own: it comes after the
other tests on the module's system.

And (from test_local_state.py, each test on a system of its own with that module's settings): local
state, with the real services. It never stops a service: every SQLite file the ingest and the monitor
keep is overwritten with garbage (one truncated instead) while they are stopped; started again on their
ports, they set each file aside, say so once, count it, are ready, and answer from views rebuilt from
the streams with what they answered before. And a restart does not repeat itself: the monitor's alert
book is kept with its checkpoint, so a restarted monitor tells nothing twice and still resolves what
ended while it was down.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aio_pika
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import services
from support.amqp import event, publish_event
from support.monitoring import publish, set_status, wait_leader
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

from hookline.shared.outbound import signing

pytestmark = pytest.mark.e2e

SECRET = "whsec_" + "c2luay1zZWNyZXQtZm9yLXRoZS10ZXN0cy0wMTIz"
SYSTEM_ENV = {
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "3",
    "HOOKLINE_BREAKER_COOLDOWN_S": "3",
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_QUEUE_POLL_S": "0.5",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    "HOOKLINE_DISABLE_AFTER_S": "25",
    "HOOKLINE_ALERT_WEBHOOK_SECRET": SECRET,  # the alert sinks' (test_alert_sinks.py's)
}


def health(system: System, endpoint_id: str) -> dict[str, Any]:
    with system.monitor_api() as api:
        response = api.get(f"/v1/endpoints/{endpoint_id}/health")
    assert response.status_code == 200, response.text
    view: dict[str, Any] = response.json()
    return view


async def wait_health(system: System, endpoint_id: str, check: Any, timeout_s: float = 30) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        view = await asyncio.to_thread(health, system, endpoint_id)
        return view if check(view) else None

    return await eventually(probe, timeout_s=timeout_s)


async def test_a_failing_endpoint_opens_probes_doubles_and_recovers(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    failing = True

    def respond(request: Received) -> Reply:
        return Reply(status=500 if failing and request.path == "/broken" else 204)

    receiver.responder = respond
    broken = system.add_endpoint(acme, receiver.url("/broken"), ["order.*"])
    system.add_endpoint(acme, receiver.url("/healthy"), ["invoice.*"])
    for n in range(6):
        await publish_event(
            system.amqp_url, event(acme, "order.created", f"evt_broken_{n}"), f"{acme}.order.created"
        )

    opened = await wait_health(system, broken["id"], lambda v: v["breaker_state"] == "open")
    assert opened["consecutive_failures"] >= 3
    attempts_at_open = len([r for r in receiver.requests if r.path == "/broken"])
    # While open: the healthy endpoint runs at full speed beside it.
    for n in range(50):
        await publish_event(
            system.amqp_url, event(acme, "invoice.paid", f"evt_healthy_{n}"), f"{acme}.invoice.paid"
        )
    await receiver.wait_for(50, path="/healthy", timeout_s=10)

    # After the cooldown, exactly one probe (across both dispatchers); it fails: open again, doubled. The
    # reopening is the end of the window in which nothing but that probe (and a delivery already under
    # way when the breaker opened) may reach the broken endpoint: it cannot happen without the probe.
    reopened = await wait_health(
        system, broken["id"], lambda v: v["breaker_state"] == "open" and v["breaker_cooldown_s"] == 6
    )
    assert reopened["breaker_cooldown_s"] == 6
    probes = [
        line for line in system.logs().splitlines() if '"breaker_probe"' in line and broken["id"] in line
    ]
    assert len(probes) == 1, probes
    attempts_while_open = len([r for r in receiver.requests if r.path == "/broken"]) - attempts_at_open
    assert 1 <= attempts_while_open <= 2, "the probe, and at most a delivery under way when it opened"

    # The endpoint recovers: the next probe succeeds, the breaker closes, everything waiting is delivered.
    failing = False
    await wait_health(system, broken["id"], lambda v: v["breaker_state"] == "closed", timeout_s=30)
    delivered = {r.headers["webhook-id"] for r in receiver.requests if r.path == "/broken" and not failing}
    await eventually(
        lambda: _delivered_all(receiver, "/broken", {f"evt_broken_{n}" for n in range(6)}), timeout_s=30
    )
    assert delivered  # the probe itself was one of them


async def _delivered_all(receiver: Receiver, path: str, wanted: set[str]) -> bool:
    # Every event reached the endpoint at least once after it recovered (earlier 500s don't count).
    seen = [r.headers["webhook-id"] for r in receiver.requests if r.path == path]
    return wanted <= set(seen[-len(wanted) * 3 :])


async def test_an_endpoint_slowing_down_is_flagged_before_it_fails(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    delay_s = 0.01
    receiver.responder = lambda _: Reply(status=204, delay_s=delay_s)
    endpoint = system.add_endpoint(acme, receiver.url("/slowing"), ["#"])
    for n in range(10):
        await publish_event(system.amqp_url, event(acme, "a.b", f"evt_fast_{n}"), f"{acme}.a.b")
    await receiver.wait_for(10, path="/slowing")
    fast = await wait_health(system, endpoint["id"], lambda v: v["samples"] >= 10)
    assert fast["slow"] is False

    delay_s = 3.0
    for n in range(12):
        await publish_event(system.amqp_url, event(acme, "a.b", f"evt_slow_{n}"), f"{acme}.a.b")
    flagged = await wait_health(system, endpoint["id"], lambda v: v["slow"], timeout_s=30)
    assert flagged["breaker_state"] == "closed", "flagged while every delivery still succeeds"
    assert flagged["last_5m"]["p95_ms"] > 2000  # each took 3 s at least
    assert 0 < fast["p95_ms"] < flagged["last_5m"]["p95_ms"], (fast, flagged)
    assert flagged["success_rate"] == 1.0

    async def alert_firing() -> bool:
        with system.monitor_api() as api:
            firing = api.get("/v1/alerts").json()
        return any(a["alert"] == "slow_endpoint" and a["endpoint_id"] == endpoint["id"] for a in firing)

    await eventually(alert_firing)


async def test_status_and_analysis_answer_the_sre_questions(system: System, receiver: Receiver) -> None:
    acme = tenant()
    receiver.responder = lambda r: Reply(status=400 if r.path == "/rejects" else 204)
    good = system.add_endpoint(acme, receiver.url("/good"), ["good.*"])
    rejects = system.add_endpoint(acme, receiver.url("/rejects"), ["bad.*"])
    for n in range(20):
        await publish_event(system.amqp_url, event(acme, "good.one", f"evt_good_{n}"), f"{acme}.good.one")
    for n in range(3):
        await publish_event(system.amqp_url, event(acme, "bad.one", f"evt_bad_{n}"), f"{acme}.bad.one")
    await receiver.wait_for(23)

    # The depth comes from queue polling, which may not have reached a new endpoint yet.
    view = await wait_health(
        system, good["id"], lambda v: v["samples"] >= 20 and v["queue_depth"] is not None
    )
    assert view["success_rate"] == 1.0
    assert 0 < view["p50_ms"] <= view["p95_ms"] <= view["p99_ms"]
    assert view["queue_depth"] == 0

    async def analysed() -> list[dict[str, Any]] | None:
        with system.monitor_api() as api:
            rows = api.get("/v1/dead-letters/analysis", params={"tenant": acme}).json()
        return rows if rows and rows[0]["count"] == 3 else None

    [row] = await eventually(analysed)
    assert (row["endpoint_id"], row["most_common_status"], row["most_common_reason"], row["mean_attempts"]) == (
        rejects["id"], 400, "permanent_status", 1.0,
    )  # fmt: skip

    with system.monitor_api() as api:
        summary = api.get("/v1/status").json()
        types = {row["type"]: row for row in api.get("/v1/types/health").json()}
    assert summary["delivered_last_hour"] >= 20
    assert summary["dead_letter"] >= 3
    assert summary["dispatchers"] == 2
    assert types["good.one"]["last_24h"]["samples"] >= 20

    env = {**system.env, "HOOKLINE_MONITOR_URL": system.monitor.base_url}
    shown = await asyncio.to_thread(
        subprocess.run, [services.HOOKLINE, "status"], env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert "delivered/1h" in shown.stdout
    assert "broker: taking publishes" in shown.stdout
    assert good["id"] in shown.stdout
    raw = await asyncio.to_thread(
        subprocess.run,
        [services.HOOKLINE, "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(raw.stdout)["summary"]["dispatchers"] == 2


async def test_a_restarted_monitor_reports_the_same_percentiles(system: System, receiver: Receiver) -> None:
    acme = tenant()
    delays = iter([0.005 * n for n in range(1, 41)])
    receiver.responder = lambda _: Reply(status=204, delay_s=next(delays, 0.01))
    endpoint = system.add_endpoint(acme, receiver.url("/measured"), ["#"])
    for n in range(40):
        await publish_event(system.amqp_url, event(acme, "a.b", f"evt_measured_{n}"), f"{acme}.a.b")
    before = await wait_health(system, endpoint["id"], lambda v: v["samples"] >= 40)

    system.restart_monitor()
    after = await wait_health(system, endpoint["id"], lambda v: v["samples"] >= 40)
    assert after["samples"] == before["samples"]
    for key in ("p50_ms", "p95_ms", "p99_ms"):
        assert abs(after[key] - before[key]) <= 0.01 * before[key], key


async def test_alerts_are_published_once_and_resolved(system: System, receiver: Receiver) -> None:
    acme = tenant()
    failing = True
    receiver.responder = lambda _: Reply(status=503 if failing else 204)
    connection = await aio_pika.connect(system.amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind("alerts", routing_key="breaker_open.*")
        endpoint = system.add_endpoint(acme, receiver.url("/alerting"), ["#"])
        for n in range(4):
            await publish_event(system.amqp_url, event(acme, "a.b", f"evt_alert_{n}"), f"{acme}.a.b")
        await wait_health(system, endpoint["id"], lambda v: v["breaker_state"] == "open")
        failing = False
        await wait_health(system, endpoint["id"], lambda v: v["breaker_state"] == "closed", timeout_s=30)
        received: list[str] = []

        async def resolved() -> bool:
            while (message := await queue.get(no_ack=True, fail=False)) is not None:
                body = json.loads(message.body)
                if body["endpoint_id"] == endpoint["id"]:
                    received.append(body["state"])
            return "resolved" in received

        # The resolution goes out at the next alert evaluation (every 2 s) after the breaker closed.
        await eventually(resolved, timeout_s=15)
    assert received == ["firing", "resolved"], "deduplicated while it lasts, resolved when it ends"


# Open too long is 6 s on a system of its own: the module's 25 s keeps its other tests' endpoints enabled.
@pytest.mark.system_env({**SYSTEM_ENV, "HOOKLINE_DISABLE_AFTER_S": "6"})
async def test_an_endpoint_open_too_long_is_disabled_and_its_tenant_told(
    own_system: System, receiver: Receiver
) -> None:
    system = own_system
    acme = tenant()
    receiver.responder = lambda r: Reply(status=500 if r.path == "/dead" else 204)
    dead = system.add_endpoint(acme, receiver.url("/dead"), ["order.*"])
    system.add_endpoint(acme, receiver.url("/ops"), ["hookline.#"])  # the tenant's operational events
    for n in range(4):
        await publish_event(
            system.amqp_url, event(acme, "order.created", f"evt_dead_{n}"), f"{acme}.order.created"
        )
    await wait_health(system, dead["id"], lambda v: v["status"] == "disabled", timeout_s=60)
    [notice] = await receiver.wait_for(1, path="/ops", timeout_s=20)
    body = json.loads(notice.body)
    assert (body["type"], body["tenant"], body["data"]["endpoint_id"]) == (
        "hookline.endpoint.disabled",
        acme,
        dead["id"],
    )


async def test_alerts_reach_the_operators_sinks_routed_signed_and_in_slack_form(
    system: System, receiver: Receiver
) -> None:
    failing = True
    sunk: dict[str, list[Received]] = {"/ops": [], "/slack": []}

    def respond(request: Received) -> Reply:
        if request.path in sunk:
            sunk[request.path].append(request)
            return Reply(status=200)
        return Reply(status=500 if failing else 204)

    receiver.responder = respond
    system.env["HOOKLINE_ALERT_WEBHOOK_URLS"] = (
        f"breaker_*={receiver.url('/ops')}, slack+{receiver.url('/slack')}"
    )
    await asyncio.to_thread(system.restart_monitor)
    await wait_leader(system.monitor)

    acme = tenant()
    endpoint = system.add_endpoint(acme, receiver.url("/broken"), ["#"])
    await publish(system, acme, "a.b", [f"evt_sink_{n}" for n in range(4)])

    def states(path: str) -> list[tuple[str, str]]:
        bodies = [json.loads(r.body) for r in sunk[path]]
        if path == "/slack":
            return [("text", body["text"]) for body in bodies]
        return [(body["alert"], body["state"]) for body in bodies if body["endpoint_id"] == endpoint["id"]]

    await eventually(lambda: _true(("breaker_open", "firing") in states("/ops")), timeout_s=30)
    failing = False
    await eventually(lambda: _true(("breaker_open", "resolved") in states("/ops")), timeout_s=30)
    assert states("/ops") == [("breaker_open", "firing"), ("breaker_open", "resolved")]

    # Signed like every hookline delivery, with the alert's id as webhook-id.
    for request in sunk["/ops"]:
        headers = request.headers
        assert signing.verify(
            SECRET,
            headers["webhook-id"],
            int(headers["webhook-timestamp"]),
            request.body,
            headers["webhook-signature"],
        )

    # Slack gets text, for every alert (not only breaker ones), the endpoint named in it. Each sink is
    # posted to on its own: Slack's "resolved" may come a moment after the other sink's.
    def texts() -> list[str]:
        return [text for _, text in states("/slack") if endpoint["id"] in text]

    await eventually(
        lambda: _true(any(t.startswith(":large_green_circle: *breaker_open* resolved") for t in texts())),
        explain=lambda: str(texts()),
    )
    assert any(t.startswith(":red_circle: *breaker_open* firing") for t in texts()), texts()


async def _true(value: Any) -> bool:
    return bool(value)


LOCAL_STATE_ENV = {
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


@pytest.mark.system_env(LOCAL_STATE_ENV)
async def test_garbage_over_every_local_file_costs_a_rebuild_not_the_service(
    own_system: System, receiver: Receiver
) -> None:
    system = own_system  # the settings of its own (system_env)

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


@pytest.mark.system_env(LOCAL_STATE_ENV)
async def test_a_restarted_monitor_tells_nothing_twice_and_resolves_what_ended_meanwhile(
    own_system: System, receiver: Receiver
) -> None:
    system = own_system  # the settings of its own (system_env)
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
