"""The health monitor with real services: breakers, probes, slow endpoints, alerts, status, restarts.

Times are shrunk through settings: 3 consecutive failures open a breaker, the first cooldown is 3 s.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

import aio_pika
import pytest
from support import services
from support.amqp import event, publish_event
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

SYSTEM_ENV = {
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "3",
    "HOOKLINE_BREAKER_COOLDOWN_S": "3",
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_QUEUE_POLL_S": "0.5",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    "HOOKLINE_DISABLE_AFTER_S": "25",
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


async def test_an_endpoint_open_too_long_is_disabled_and_its_tenant_told(
    system: System, receiver: Receiver
) -> None:
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
