"""Faults lose nothing: a dispatcher killed mid-work, endpoints that hang or drop the connection.

And (from test_control_plane.py, on a system of its own with that module's settings): the control plane
under operations: broker restarts and closed connections with breakers open.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from support import services
from support.amqp import event, publish_event
from support.broker import Broker
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.serial]

# These tests fail many attempts on purpose; a breaker opening would hold the retries back.
SYSTEM_ENV = {"HOOKLINE_BREAKER_FAILURE_THRESHOLD": "1000"}


async def test_a_killed_dispatcher_loses_nothing_in_flight_or_waiting(
    own_system: System, receiver: Receiver
) -> None:
    system = own_system  # it kills a service: a system of its own
    acme = tenant()
    seen: set[str] = set()
    delivered: set[str] = set()

    def respond(request: Received) -> Reply:
        event_id = request.headers["webhook-id"]
        if event_id not in seen:  # every first attempt fails: the event goes to the delay queues
            seen.add(event_id)
            return Reply(status=500)
        delivered.add(event_id)  # later attempts hang a while, so some are in flight at the kill
        return Reply(status=204, delay_s=1.0)

    receiver.responder = respond
    system.add_endpoint(acme, receiver.url("/killed"), ["#"], retry_schedule_s=[2])
    first = [f"evt_kill_{n}" for n in range(40)]
    for event_id in first:
        await publish_event(system.amqp_url, event(acme, "a.b", event_id), f"{acme}.a.b")
    await receiver.wait_for(40 + 5, path="/killed", timeout_s=30)  # some second attempts are under way
    second = [f"evt_kill_late_{n}" for n in range(20)]
    for event_id in second:
        await publish_event(system.amqp_url, event(acme, "a.b", event_id), f"{acme}.a.b")

    for dispatcher in system.dispatchers:
        dispatcher.kill()  # SIGKILL: no drain, no acks, no goodbye
    in_flight_at_kill = len(seen) + len(delivered)
    system.start_dispatcher("dispatcher-after-kill")

    async def all_delivered() -> bool:
        return delivered >= set(first) | set(second)

    deadline = asyncio.get_running_loop().time() + 60
    while not await all_delivered():
        assert asyncio.get_running_loop().time() < deadline, sorted(set(first) | set(second) - delivered)
        await asyncio.sleep(0.2)
    assert in_flight_at_kill > 40


async def test_an_endpoint_that_hangs_times_out_and_is_retried(system: System, receiver: Receiver) -> None:
    acme = tenant()
    replies = [Reply(status=204, delay_s=3.0), Reply(status=204)]
    receiver.responder = lambda _: replies.pop(0) if replies else Reply(status=204)
    system.add_endpoint(acme, receiver.url("/hangs"), ["#"], timeout_s=1)
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_hang_1"), f"{acme}.a.b")
    first, second = await receiver.wait_for(2, path="/hangs", timeout_s=30)
    assert first.headers["webhook-id"] == second.headers["webhook-id"] == "evt_hang_1"
    await eventually(lambda: asyncio.to_thread(lambda: '"error":"timeout"' in system.logs()))


async def test_an_endpoint_that_drops_the_connection_is_retried(system: System, receiver: Receiver) -> None:
    acme = tenant()
    replies = [Reply(close=True), Reply(close=True), Reply(status=200)]
    receiver.responder = lambda _: replies.pop(0) if replies else Reply(status=204)
    system.add_endpoint(acme, receiver.url("/drops"), ["#"])
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_drop_1"), f"{acme}.a.b")
    attempts = await receiver.wait_for(3, path="/drops", timeout_s=30)
    assert {a.headers["webhook-id"] for a in attempts} == {"evt_drop_1"}
    await eventually(lambda: asyncio.to_thread(lambda: '"error":"network"' in system.logs()))


async def test_services_survive_a_broker_restart(
    system: System, receiver: Receiver, rabbitmq: Broker
) -> None:
    acme = tenant()
    system.add_endpoint(acme, receiver.url("/restart"), ["#"])
    for n in range(10):
        await publish_event(system.amqp_url, event(acme, "a.b", f"evt_before_{n}"), f"{acme}.a.b")
    await receiver.wait_for(10, path="/restart")

    # The broker goes away and comes back (the RabbitMQ application, not the machine).
    await rabbitmq.restart_app()

    async def published_after() -> bool:
        try:
            await publish_event(system.amqp_url, event(acme, "a.b", "evt_after_0"), f"{acme}.a.b")
        except Exception:
            return False
        return True

    await eventually(published_after, timeout_s=60, every_s=1)
    for n in range(1, 10):
        await publish_event(system.amqp_url, event(acme, "a.b", f"evt_after_{n}"), f"{acme}.a.b")
    # Every dispatcher reconnected and resumed consuming (the endpoint log followed, too).
    # Redeliveries of messages unacked at the restart are expected, so wait for the ids, not a count.
    expected = {f"evt_{when}_{n}" for when in ("before", "after") for n in range(10)}
    delivered = await receiver.wait_for_ids(expected, path="/restart", timeout_s=90)
    assert {r.headers["webhook-id"] for r in delivered} == expected
    # A new endpoint registered after the restart reaches the dispatchers through the endpoint log.
    system.add_endpoint(acme, receiver.url("/after-restart"), ["x.y"])
    await publish_event(system.amqp_url, event(acme, "x.y", "evt_new_endpoint"), f"{acme}.x.y")
    await receiver.wait_for(1, path="/after-restart", timeout_s=30)
    # And every service is ready again: a loop that lost its channel a second time, to a broker still
    # starting, is back within its restart pause (which grows to a few seconds), not at once.
    running = [s for s in (system.ingest, *system.dispatchers, *system.extra, system.monitor) if not s.killed]
    for service in running:
        await ready_within(service, timeout_s=30)


async def ready_within(service: services.Service, *, timeout_s: float) -> None:
    said = ""

    async def ready() -> bool:
        nonlocal said
        answer = await asyncio.to_thread(httpx.get, f"{service.base_url}/readyz", timeout=5)
        said = answer.text
        return answer.status_code == 200

    await eventually(ready, timeout_s=timeout_s, every_s=0.5, explain=lambda: f"{service.name}: {said}")


CONTROL_PLANE_ENV = {
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "3",
    "HOOKLINE_BREAKER_COOLDOWN_S": "5",
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_QUEUE_POLL_S": "0.5",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
}


def health(system: System, endpoint_id: str) -> dict[str, Any] | None:
    try:
        with system.monitor_api() as api:
            response = api.get(f"/v1/endpoints/{endpoint_id}/health")
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


async def wait_breaker(system: System, endpoint_id: str, state: str, timeout_s: float = 30) -> None:
    async def reached() -> bool:
        view = await asyncio.to_thread(health, system, endpoint_id)
        return view is not None and view["breaker_state"] == state

    await eventually(reached, timeout_s=timeout_s)


@pytest.mark.system_env(CONTROL_PLANE_ENV)
async def test_an_open_breaker_closes_after_a_broker_restart(
    own_system: System, receiver: Receiver, rabbitmq: Broker
) -> None:
    system = own_system  # the settings of its own (system_env)
    acme = tenant()
    failing = True
    receiver.responder = lambda _: Reply(status=500 if failing else 204)
    endpoint = system.add_endpoint(acme, receiver.url("/restarted"), ["#"])
    for n in range(10):
        await publish_event(system.amqp_url, event(acme, "a.b", f"evt_waiting_{n}"), f"{acme}.a.b")
    await wait_breaker(system, endpoint["id"], "open")

    await rabbitmq.restart_app(down_s=3)  # stop_app; sleep 3; start_app, as in the report
    failing = False

    # The cooldown ends, a probe succeeds, the breaker closes and every waiting event is delivered.
    await wait_breaker(system, endpoint["id"], "closed", timeout_s=90)

    async def all_delivered() -> bool:
        ok = {r.headers["webhook-id"] for r in receiver.requests if r.path == "/restarted"}
        return ok >= {f"evt_waiting_{n}" for n in range(10)}

    await eventually(all_delivered, timeout_s=60)
