"""An ordered endpoint's subject is never blocked for ever by an event another replica settled.

Order lives in the memory of the dispatcher that serves the endpoint (its queue has a single active
consumer). When that dispatcher loses the endpoint for a while and another one finishes an event it was
waiting for (a failover, or the breaker's probe), the first one still has the event as outstanding. It
used to defer every later event of that subject each second, for ever; now the event holds its subject
back only until ``HOOKLINE_ORDER_HOLD_S`` after it was due.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from support import broker as test_broker
from support import services
from support.amqp import event, publish_event
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

HOLD_S = 3
SYSTEM_ENV = {
    "HOOKLINE_ORDER_HOLD_S": str(HOLD_S),
    # Long enough for the two rabbitmqctl calls below on a loaded machine (seconds each): the retry must
    # come after the connection is closed, or the dispatcher that failed it retries it itself.
    "HOOKLINE_RETRY_SCHEDULE_S": "8",
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "1000",
}


def ordered_event(tenant_name: str, event_id: str, subject: str) -> dict[str, object]:
    return {**event(tenant_name, "a.b", event_id), "subject": subject}


async def test_a_subject_moves_on_after_a_failover_settled_its_earlier_event(
    own_system: System, receiver: Receiver, rabbitmq: test_broker.Broker
) -> None:
    system = own_system  # it kills a service: a system of its own
    acme = tenant()
    failed: set[str] = set()

    def respond(request: Received) -> Reply:
        event_id = request.headers["webhook-id"]
        if event_id == "evt_first" and event_id not in failed:
            failed.add(event_id)
            return Reply(status=500)  # retried in 8 s: outstanding in its dispatcher's memory
        return Reply(status=204)

    receiver.responder = respond
    endpoint = system.add_endpoint(acme, receiver.url("/ordered"), ["#"], ordered=True)
    await publish_event(system.amqp_url, ordered_event(acme, "evt_first", "s1"), f"{acme}.a.b")
    await receiver.wait_for(1, path="/ordered")

    # The dispatcher that attempted it (the queue's active consumer) loses its connection: the other one
    # becomes active, and delivers the retry; the first one comes back as a standby, still remembering.
    async def attempted_by() -> services.Service | None:
        return next((d for d in system.dispatchers if '"event_id":"evt_first"' in d.log()), None)

    active = await eventually(attempted_by)
    other = next(d for d in system.dispatchers if d is not active)
    vhost = system.amqp_url.rsplit("/", 1)[1]
    before = await rabbitmq.connections(vhost)
    await rabbitmq.ctl_async(
        ["close_connection", before[f"hookline-dispatcher:{active.process.pid}"], "test"]
    )
    await receiver.wait_for(2, path="/ordered", timeout_s=30)

    async def retried_by_the_other() -> bool:
        return '"event_id":"evt_first"' in other.log()

    await eventually(retried_by_the_other)

    async def reattached() -> bool:
        return f"hookline-dispatcher:{active.process.pid}" in await rabbitmq.connections(vhost)

    await eventually(reattached, timeout_s=30)
    await eventually(lambda: _ready(active), timeout_s=30)
    # Now the other one goes: the first dispatcher serves the endpoint again, with its stale memory.
    other.kill()
    for n in range(3):
        await publish_event(system.amqp_url, ordered_event(acme, f"evt_later_{n}", "s1"), f"{acme}.a.b")

    # Every later event of s1 is delivered, in order, within the hold time (not deferred for ever).
    await receiver.wait_for(5, path="/ordered", timeout_s=HOLD_S + 30)
    later = [json.loads(r.body)["id"] for r in receiver.requests if r.path == "/ordered"][2:]
    assert later == [f"evt_later_{n}" for n in range(3)]
    assert endpoint["ordered"] is True


async def _ready(service: services.Service) -> bool:
    try:
        answer = await asyncio.to_thread(httpx.get, f"{service.base_url}/readyz", timeout=2)
    except httpx.HTTPError:
        return False
    return answer.status_code == 200
