"""Several health monitors, a silent monitor, and topology damaged by hand, with the real services.

Times are shrunk through settings: 3 consecutive failures open a breaker, the first cooldown is 3 s,
the monitor ticks every 0.2 s and polls the queues every 0.5 s, and a breaker that no monitor renewed
for 10 s is closed by the dispatchers themselves (the lease).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx
import pytest
from support import services
from support.broker import Broker
from support.logs import logged, records
from support.monitoring import get_json, publish, set_status, wait_leader
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

LEASE_S = 10.0
SYSTEM_ENV = {
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "3",
    "HOOKLINE_BREAKER_COOLDOWN_S": "3",
    "HOOKLINE_TICK_S": "0.2",
    # Polled often, the monitor finds a queue deleted by hand before the broker has told its consumers;
    # declared again then, the queue kept them without a word (two runs of five, before
    # topology.REDECLARE_AFTER_S; tests/integration/test_redeclare_after.py).
    "HOOKLINE_QUEUE_POLL_S": "0.1",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    "HOOKLINE_BREAKER_LEASE_S": str(int(LEASE_S)),
    "HOOKLINE_CONSUMER_CHECK_S": "3",
}
# --- the receiver's side -------------------------------------------------------------------------------


class Paths:
    """What each path of the receiver answers: 500 while it is failing, else its status (204 by default);
    the event ids each path accepted with a 2xx."""

    def __init__(self, receiver: Receiver) -> None:
        self.failing: set[str] = set()
        self.status: dict[str, int] = {}
        self.accepted: dict[str, list[str]] = defaultdict(list)
        self.accepted_at: dict[str, list[float]] = defaultdict(list)  # time.time() of each
        receiver.responder = self._respond

    def _respond(self, request: Received) -> Reply:
        if request.path in self.failing:
            return Reply(status=500)
        status = self.status.get(request.path, 204)
        if status < 300:
            self.accepted[request.path].append(request.headers["webhook-id"])
            self.accepted_at[request.path].append(request.at)
        return Reply(status=status)

    async def wait_accepted(self, path: str, ids: Iterable[str], timeout_s: float = 30) -> float:
        """Wait until ``path`` accepted every one of ``ids``; returns when (time.monotonic())."""
        wanted = set(ids)

        async def all_there() -> bool:
            return wanted <= set(self.accepted[path])

        await eventually(all_there, timeout_s=timeout_s, every_s=0.1)
        return time.monotonic()


# --- the services' side --------------------------------------------------------------------------------


def running_monitors(system: System) -> list[services.Service]:
    every = [system.monitor, *system.extra]
    return [s for s in every if s.command == "health-monitor" and not s.killed and s.process.poll() is None]


async def breaker_state(monitor: services.Service, endpoint_id: str) -> str | None:
    view = await get_json(monitor, f"/v1/endpoints/{endpoint_id}/health")
    return None if view is None else str(view["breaker_state"])


async def wait_breaker(
    monitor: services.Service, endpoint_id: str, state: str, timeout_s: float = 30
) -> None:
    async def reached() -> bool:
        return await breaker_state(monitor, endpoint_id) == state

    await eventually(reached, timeout_s=timeout_s)


def vhost_of(system: System) -> str:
    return unquote(urlsplit(system.amqp_url).path.lstrip("/"))


async def start_monitor(system: System, name: str) -> services.Service:
    monitor = services.start("health-monitor", system.env, system.log_dir, name=name)
    system.extra.append(monitor)
    await asyncio.to_thread(monitor.wait_ready, 60)
    return monitor


def make_main_monitor(system: System, monitor: services.Service) -> None:
    """``monitor`` becomes the system's monitor (the fixture stops it at the end); the previous one stays
    in ``extra`` so that its log is kept (a killed one is left out of the clean-exit check)."""
    if monitor is system.monitor:
        return
    system.extra.remove(monitor)
    system.extra.append(system.monitor)
    system.monitor = monitor


# --- the tests -----------------------------------------------------------------------------------------


async def test_two_monitors_one_leads_and_the_other_takes_over_with_the_breakers(
    own_system: System, receiver: Receiver
) -> None:
    """Two monitors: exactly one leads, both answer the status API and agree on a breaker (the standby
    mirrors the log); SIGKILL the leader and the other leads within seconds, carries the open breaker
    on, and moves breakers itself: a new failure opens one, recoveries close them, nothing is lost."""
    system = own_system  # it kills a service: a system of its own
    acme = tenant()
    paths = Paths(receiver)
    second = await start_monitor(system, "health-monitor-b")
    pair = [system.monitor, second]

    async def one_leader() -> services.Service | None:
        summaries = [await get_json(monitor, "/v1/status") for monitor in pair]
        if None in summaries:
            return None
        leaders = [monitor for monitor, summary in zip(pair, summaries, strict=True) if summary["leader"]]
        return leaders[0] if len(leaders) == 1 else None

    leader = await eventually(one_leader)
    [standby] = [monitor for monitor in pair if monitor is not leader]
    for _ in range(5):  # and it stays that way: never two leaders, never a change without a cause
        assert await one_leader() is leader
        await asyncio.sleep(0.2)

    first = system.add_endpoint(acme, receiver.url("/first"), ["first.*"])
    later = system.add_endpoint(acme, receiver.url("/later"), ["later.*"])
    paths.failing.add("/first")
    first_ids = await publish(system, acme, "first.created", [f"evt_first_{n}" for n in range(4)])

    async def both_open() -> bool:
        views = [await get_json(m, f"/v1/endpoints/{first['id']}/health") for m in pair]
        if None in views:
            return False
        keys = [(v["breaker_state"], v["breaker_cooldown_s"], v["consecutive_failures"]) for v in views]
        return keys[0][0] == "open" and keys[0] == keys[1]

    await eventually(both_open, timeout_s=30)
    for monitor in pair:
        summary = await get_json(monitor, "/v1/status")
        assert summary["breakers_open"] >= 1
        assert summary["endpoints"] >= 2
        assert summary["dispatchers"] == 2
        [row] = [
            r
            for r in await get_json(monitor, "/v1/endpoints/health", tenant=acme)
            if r["endpoint_id"] == later["id"]
        ]
        assert row["breaker_state"] == "closed"

    killed_at = time.monotonic()
    leader.kill()
    # The standby tries the lock every second and gets it once the broker dropped the dead leader's:
    # within the deadline (a stopwatch on a loaded machine says more about the machine than about it).
    took_over_at = await wait_leader(standby, timeout_s=15)
    print(f"\ntakeover after SIGKILL of the leading monitor: {took_over_at - killed_at:.2f} s")
    make_main_monitor(system, standby)

    # Under the new leader: an endpoint that starts failing now opens its breaker...
    paths.failing.add("/later")
    later_ids = await publish(system, acme, "later.created", [f"evt_later_{n}" for n in range(4)])
    await wait_breaker(standby, later["id"], "open")
    # ...and once both endpoints recover, their probes close both breakers and everything waiting goes out.
    paths.failing.clear()
    await wait_breaker(standby, first["id"], "closed", timeout_s=40)
    await wait_breaker(standby, later["id"], "closed", timeout_s=40)
    await paths.wait_accepted("/first", first_ids)
    await paths.wait_accepted("/later", later_ids)
    assert logged([standby], "monitor_leading"), "the survivor says it took over"


async def test_dispatchers_are_never_blocked_on_a_silent_monitor(
    own_system: System, receiver: Receiver
) -> None:
    """An open breaker whose monitors all died is closed by the dispatchers once its lease (10 s) runs
    out, with an alert in their logs; a monitor started again takes over without losing anything."""
    system = own_system  # it kills a service: a system of its own
    acme = tenant()
    paths = Paths(receiver)
    endpoint = system.add_endpoint(acme, receiver.url("/silenced"), ["#"])
    paths.failing.add("/silenced")
    waiting = await publish(system, acme, "a.b", [f"evt_silenced_{n}" for n in range(5)])
    await wait_breaker(system.monitor, endpoint["id"], "open")

    async def told() -> bool:
        # The monitor's API says open once it decides; the dispatchers hold the breaker only once the
        # command is published (after the endpoint's queue of its own is there): a monitor killed before
        # that never opened it for them (a CI run killed it 1 s early and saw the events delivered).
        return bool(logged([system.monitor], "breaker_changed", endpoint_id=endpoint["id"], state="open"))

    await eventually(told, timeout_s=30)
    killed_at = time.monotonic()
    for monitor in running_monitors(system):
        monitor.kill()
    paths.failing.clear()  # the endpoint has recovered; nobody is left to close its breaker

    # Within the lease after the last renewal (a snapshot, every 5 s) before the kill, plus the second
    # between the dispatchers' checks: the deadline leaves room for a loaded machine. What lets them
    # through is asserted below: the lease running out (breaker_expired), not a monitor.
    resumed_at = await paths.wait_accepted("/silenced", waiting, timeout_s=LEASE_S + 15)
    resumed_s = resumed_at - killed_at
    print(f"\ndeliveries resumed {resumed_s:.1f} s after every monitor was killed (lease {LEASE_S:.0f} s)")
    expired = logged(system.dispatchers, "breaker_expired", endpoint_id=endpoint["id"])
    assert expired, "the dispatchers said that they closed the breaker on their own"
    assert all(line["alert"] is True for line in expired)
    # It was the lease that let them through: before it ran out, at most the half-open probe went out.
    expired_at = min(datetime.fromisoformat(line["ts"]).timestamp() for line in expired)
    assert len([at for at in paths.accepted_at["/silenced"] if at < expired_at]) <= 1

    # A monitor again: it takes over the breakers from the log (this one it reopens until a probe
    # succeeds, which takes an event to probe with), and closes it; nothing is lost.
    monitor = await start_monitor(system, "health-monitor-c")
    make_main_monitor(system, monitor)
    await wait_leader(monitor)
    sent: list[str] = []

    async def closed_again() -> bool:
        if await breaker_state(monitor, endpoint["id"]) == "closed":
            return True
        if len(sent) == len(set(paths.accepted["/silenced"]) & set(sent)):
            sent.extend(await publish(system, acme, "a.b", [f"evt_after_{len(sent)}"]))
        return False

    await eventually(closed_again, timeout_s=40, every_s=0.5)
    await paths.wait_accepted("/silenced", sent)


async def test_a_queue_deleted_by_hand_is_declared_again(
    system: System, receiver: Receiver, rabbitmq: Broker
) -> None:
    """An endpoint's queue of its own deleted with rabbitmqctl: the dispatchers consuming it (a capped
    endpoint's) provision it again at once (events published afterwards are delivered); a queue nobody
    consumes (a paused endpoint's) is found by the leading monitor, alerted on and declared again with its
    binding; queue polling goes on reporting the depth of the other endpoints."""
    acme = tenant()
    paths = Paths(receiver)
    # A cap needs a single consumer, so a queue of its own: consumed by both dispatchers.
    active = system.add_endpoint(acme, receiver.url("/active"), ["active.*"], max_in_flight=10)
    idle = system.add_endpoint(acme, receiver.url("/idle"), ["idle.*"])
    paused = system.add_endpoint(acme, receiver.url("/paused"), ["paused.*"])
    await set_status(system, idle["id"], "pause")
    await set_status(system, paused["id"], "pause")
    await paths.wait_accepted("/active", await publish(system, acme, "active.x", ["evt_active_before"]))
    await publish(system, acme, "paused.x", [f"evt_paused_{n}" for n in range(2)])

    async def depth(endpoint_id: str, expected: int) -> bool:
        view = await get_json(system.monitor, f"/v1/endpoints/{endpoint_id}/health")
        return view is not None and view["queue_depth"] == expected

    await eventually(lambda: depth(paused["id"], 2))
    await eventually(lambda: depth(idle["id"], 0))

    vhost = vhost_of(system)
    for endpoint in (active, idle):
        await rabbitmq.ctl_async(["delete_queue", "-p", vhost, f"hookline.endpoint.{endpoint['id']}"])

    # The consumed queue: the dispatchers were told (their consumers were cancelled; or, when no cancel
    # came, their check with the broker found it without consumers) and provision it, unless the
    # monitor's next poll got there first (a loaded machine); either way they consume it again.
    async def reprovisioned() -> bool:
        told = logged(system.dispatchers, "consumer_cancelled_by_broker", endpoint_id=active["id"]) or logged(
            system.dispatchers, "consumer_missing_at_broker", endpoint_id=active["id"]
        )
        by_dispatcher = logged(
            system.dispatchers, "endpoint_queue_missing", endpoint_id=active["id"], alert=True
        )
        by_monitor = [
            r
            for r in logged([system.monitor], "topology_repaired")
            if f"hookline.endpoint.{active['id']}" in r.get("declared", [])
        ]
        return bool(told and (by_dispatcher or by_monitor))

    def what_was_logged() -> str:
        about = [
            f"{service.name}: {r.get('event')} {r.get('queue') or r.get('declared') or r.get('error') or r.get('message') or ''}"
            for service in (*system.dispatchers, system.monitor)
            for r in records(service)
            if r.get("endpoint_id") == active["id"] or r.get("level") in ("warning", "error")
        ]
        return f"what was logged about the active endpoint, and warnings: {about[-30:]}"

    await eventually(reprovisioned, explain=what_was_logged)
    await paths.wait_accepted(
        "/active", await publish(system, acme, "active.x", ["evt_active_1", "evt_active_2"])
    )

    # The queue nobody consumes: the leading monitor finds it missing, alerts and declares it again.
    async def alerted() -> bool:
        firing = await get_json(system.monitor, "/v1/alerts") or []
        return any(a["alert"] == "queue_missing" and a["endpoint_id"] == idle["id"] for a in firing)

    await eventually(alerted)
    [missing, *_] = logged([system.monitor], "queue_missing", endpoint_id=idle["id"])
    assert missing["alert"] is True
    assert missing["queue"] == f"hookline.endpoint.{idle['id']}"

    async def repaired() -> bool:
        return any(
            f"hookline.endpoint.{idle['id']}" in r.get("declared", [])
            for r in logged([system.monitor], "topology_repaired")
        )

    await eventually(repaired)
    # Declared with its bindings: events for it queue up again (the depth says so) and go out on resume.
    idle_ids = await publish(system, acme, "idle.x", ["evt_idle_1", "evt_idle_2"])
    await eventually(lambda: depth(idle["id"], 2))
    await set_status(system, idle["id"], "resume")
    await paths.wait_accepted("/idle", idle_ids)

    # Polling went on for everyone else: the paused endpoint's depth follows what is published.
    await publish(system, acme, "paused.x", [f"evt_paused_{n}" for n in range(2, 5)])
    await eventually(lambda: depth(paused["id"], 5))
    assert paths.accepted["/paused"] == []


async def test_a_deleted_stream_is_declared_again_and_its_followers_resume(
    system: System, receiver: Receiver, rabbitmq: Broker
) -> None:
    """The dead-letter stream deleted with rabbitmqctl: the leading monitor declares it again and alerts
    (topology_missing); the ingest is not ready while its dead-letter follower is down, ready again
    once it follows the new stream, and a dead letter produced afterwards is listed."""
    acme = tenant()
    paths = Paths(receiver)
    endpoint = system.add_endpoint(acme, receiver.url("/rejects"), ["#"])
    paths.status["/rejects"] = 400

    readiness: list[tuple[int, str]] = []
    stop = asyncio.Event()

    async def sample_readiness() -> None:
        async with httpx.AsyncClient(base_url=system.ingest.base_url, timeout=5) as client:
            while not stop.is_set():
                try:
                    response = await client.get("/readyz")
                    readiness.append((response.status_code, response.text))
                except httpx.HTTPError as exc:
                    readiness.append((0, type(exc).__name__))
                await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample_readiness())
    try:

        async def ready_now() -> bool:
            return bool(readiness) and readiness[-1][0] == 200

        await eventually(ready_now)
        await rabbitmq.ctl_async(["delete_queue", "-p", vhost_of(system), "hookline.dead-letters"])

        async def repaired() -> bool:
            return any(
                "hookline.dead-letters" in r.get("declared", [])
                for r in logged([system.monitor], "topology_repaired")
            )

        await eventually(repaired)

        # Fired, as the monitor published it: it is in /v1/alerts only until the next evaluation finds
        # the stream there (2 s), which a loaded run could poll past.
        async def alerted() -> bool:
            fired = logged([system.monitor], "alert", alert="topology_missing", state="firing")
            return any("hookline.dead-letters" in a["detail"] for a in fired)

        await eventually(alerted)
        [missing, *_] = logged([system.monitor], "queue_missing", queue="hookline.dead-letters")
        assert missing["alert"] is True

        async def not_ready_then_ready() -> bool:
            statuses = [status for status, _ in readiness]
            return 503 in statuses and 200 in statuses[statuses.index(503) :]

        await eventually(not_ready_then_ready)
    finally:
        stop.set()
        await sampler
    [down, *_] = [text for status, text in readiness if status == 503]
    assert "dead-letters" in down, down

    # A dead letter produced now reaches the new stream and the ingest's listing.
    await publish(system, acme, "a.b", ["evt_rejected_after"])

    async def listed() -> list[dict[str, Any]] | None:
        page = await get_json(system.ingest, "/v1/dead-letters", endpoint_id=endpoint["id"])
        return page["data"] if page and page["data"] else None

    [item] = await eventually(listed)
    assert (item["event_id"], item["reason"], item["last_status"]) == (
        "evt_rejected_after",
        "permanent_status",
        400,
    )


async def test_every_service_survives_its_connection_being_closed(
    system: System, receiver: Receiver, rabbitmq: Broker
) -> None:
    """Each service's own broker connection closed with rabbitmqctl: each one connects again and is
    ready, events published afterwards are delivered, an endpoint registered afterwards works, and the
    monitor still moves breakers (its tick and leadership survived)."""
    acme = tenant()
    paths = Paths(receiver)
    system.add_endpoint(acme, receiver.url("/steady"), ["steady.*"])
    await paths.wait_accepted("/steady", await publish(system, acme, "steady.x", ["evt_steady_before"]))

    every = [system.ingest, *system.dispatchers, *running_monitors(system)]
    every += [s for s in system.extra if s.command == "dispatcher" and s.process.poll() is None]
    # Both of each service's connections: the one it consumes on and the one it publishes on.
    names = {f"hookline-{s.command}:{s.process.pid}{kind}": s for s in every for kind in ("", ":publish")}
    vhost = vhost_of(system)
    before = await rabbitmq.connections(vhost)
    assert set(names) <= set(before), f"{sorted(names)} not all in {sorted(before)}"
    for name in names:
        await rabbitmq.ctl_async(["close_connection", before[name], "closed by the test"])

    async def all_back() -> bool:
        now = await rabbitmq.connections(vhost)
        if any(now.get(name) in (None, before[name]) for name in names):
            return False
        return all([await get_json(s, "/readyz") is not None for s in every])

    await eventually(all_back, timeout_s=40, every_s=0.5)
    for service in every:
        assert logged([service], "broker_reconnected"), f"{service.name} did not say it reconnected"
    await wait_leader(system.monitor)

    # Events published afterwards are delivered; an endpoint registered afterwards works.
    await paths.wait_accepted(
        "/steady", await publish(system, acme, "steady.x", ["evt_steady_1", "evt_steady_2"])
    )
    fresh = system.add_endpoint(acme, receiver.url("/fresh"), ["fresh.*"])
    await paths.wait_accepted("/fresh", await publish(system, acme, "fresh.x", ["evt_fresh_1"]))

    # The breakers still move: failures open one, a successful probe closes it, nothing is lost.
    paths.failing.add("/fresh")
    failing_ids = await publish(system, acme, "fresh.x", [f"evt_fresh_failing_{n}" for n in range(4)])
    await wait_breaker(system.monitor, fresh["id"], "open")
    paths.failing.clear()
    await wait_breaker(system.monitor, fresh["id"], "closed", timeout_s=40)
    await paths.wait_accepted("/fresh", failing_ids)
