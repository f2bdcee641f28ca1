"""The broker restarted under the services: they resume, lose nothing, and (on a system of its own
with the control plane's settings) an open breaker closes afterwards. Serial: a restart stops every
module's broker. (A dispatcher killed mid-work and endpoints that hang or drop the connection are in
test_retries.py.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from support import services
from support.amqp import event, publish_event
from support.broker import Broker
from support.receiver import Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.serial]


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
