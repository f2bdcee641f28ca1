"""The control plane under operations: broker restarts and closed connections with breakers open."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from support.amqp import event, publish_event
from support.broker import Broker
from support.receiver import Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = [pytest.mark.e2e, pytest.mark.serial]

SYSTEM_ENV = {
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


async def test_an_open_breaker_closes_after_a_broker_restart(
    system: System, receiver: Receiver, rabbitmq: Broker
) -> None:
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
