"""Past the bound on queues of their own (here HOOKLINE_MAX_ENDPOINT_QUEUES=1, the one taken by an
endpoint with a rate limit, which has a queue of its own by its definition), an endpoint that needs
isolation is held in a shared holding lane, apart from the healthy lanes: its breaker's open time is
waited out in the delay queues, one queue write per copy per wait rather than a hand-back every second,
and nothing is lost; once the bound has room, it gets a queue of its own."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
from support.amqp import queue_exists
from support.logs import logged
from support.monitoring import counted, get_json, publish
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

from hookline.dispatcher.lanes import HELD_RECHECK_S
from hookline.shared.broker import topology

pytestmark = pytest.mark.e2e

COOLDOWN_S = 8
SYSTEM_ENV = {
    "HOOKLINE_MAX_ENDPOINT_QUEUES": "1",
    "HOOKLINE_RETIRED_QUEUE_GRACE_S": "1",
    "HOOKLINE_QUEUE_POLL_S": "0.5",
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "3",
    "HOOKLINE_BREAKER_COOLDOWN_S": str(COOLDOWN_S),
    "HOOKLINE_BREAKER_MAX_COOLDOWN_S": str(2 * COOLDOWN_S),
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    "HOOKLINE_MAX_ATTEMPTS": "1000",
}


async def take_the_bound(system: System, who: str, receiver: Receiver) -> dict[str, Any]:
    """An endpoint with a queue of its own by its definition (a rate limit), which fills the bound."""
    blocker = system.add_endpoint(who, receiver.url("/limited"), ["nothing.*"], rate_limit_per_s=5)
    assert await queue_exists(system.amqp_url, topology.endpoint_queue(blocker["id"]))
    return blocker


def delete(system: System, endpoint: dict[str, Any]) -> None:
    with system.api() as api:
        assert api.delete(f"/v1/endpoints/{endpoint['id']}").status_code == 204


async def until_health(system: System, endpoint: dict[str, Any], **expected: object) -> None:
    """Until the monitor's health of the endpoint says ``expected`` (``held=True``, …)."""

    async def says_so() -> bool:
        now = await get_json(system.monitor, f"/v1/endpoints/{endpoint['id']}/health")
        return now is not None and all(now[name] == value for name, value in expected.items())

    await eventually(says_so, timeout_s=60)


async def test_an_endpoint_held_past_the_bound_waits_out_its_breaker_and_loses_nothing(
    system: System, receiver: Receiver
) -> None:
    """Failing until its breaker opens: the monitor holds it (no queue of its own can be had); what is
    published while the breaker is open is not attempted (the probe aside), waits in the delay queues
    until the probe is due, and never passes through a healthy lane; its healthy neighbour gets every
    event meanwhile; once it answers again, every event reaches it, none is dead-lettered, and it goes
    back to its lane."""
    who = tenant()
    failing = {"now": True}
    delivered: Counter[str] = Counter()  # answered 2xx at /held

    def respond(request: Received) -> Reply:
        if request.path != "/held":
            return Reply(status=204)
        if failing["now"]:
            return Reply(status=500)
        delivered[request.headers["webhook-id"]] += 1
        return Reply(status=204)

    receiver.responder = respond
    blocker = await take_the_bound(system, who, receiver)
    endpoint = system.add_endpoint(who, receiver.url("/held"), ["h.*"])
    system.add_endpoint(who, receiver.url("/healthy"), ["h.*"])
    tripping = await publish(system, who, "h.x", [f"evt_trip_{n}" for n in range(3)])

    await until_health(system, endpoint, breaker_state="open", held=True)
    [isolated] = logged([system.monitor], "endpoint_isolated", endpoint_id=endpoint["id"])
    assert (isolated["reason"], isolated["held"]) == ("breaker_open", True)
    assert not await queue_exists(system.amqp_url, topology.endpoint_queue(endpoint["id"]))

    handed_back = 'hookline_handed_on_total{reason="breaker_open"}'
    from_holding = 'hookline_lane_messages_total{kind="held"}'
    hand_backs_before = await counted(system, handed_back)
    from_holding_before = await counted(system, from_holding)
    attempts_before = len(logged(system.dispatchers, "delivery_attempt", endpoint_id=endpoint["id"]))
    held = await publish(system, who, "h.x", [f"evt_held_{n}" for n in range(5)])
    open_since_s = time.monotonic()
    await receiver.wait_for_ids(set(held), path="/healthy", timeout_s=30)

    async def all_parked() -> bool:
        return await counted(system, handed_back) - hand_backs_before >= len(held)

    await eventually(all_parked, timeout_s=30)
    assert (
        len(logged(system.dispatchers, "delivery_attempt", endpoint_id=endpoint["id"])) <= attempts_before + 1
    )
    failing["now"] = False

    async def everything_delivered() -> bool:
        return set(delivered) >= {*tripping, *held}

    await eventually(everything_delivered, timeout_s=120)
    open_for_s = time.monotonic() - open_since_s

    # Each copy handed on once into its wait, then once per HELD_RECHECK_S at most: not once a second.
    per_copy = (await counted(system, handed_back) - hand_backs_before) / len(held)
    assert per_copy <= 2 + open_for_s / HELD_RECHECK_S, (per_copy, open_for_s)
    # Their waits began and ended in the holding lane (each copy taken from it at least twice).
    assert await counted(system, from_holding) - from_holding_before >= 2 * len(held)

    await until_health(system, endpoint, breaker_state="closed", held=False)
    assert logged([system.monitor], "endpoint_back_in_lane", endpoint_id=endpoint["id"])
    after = await publish(system, who, "h.x", ["evt_after_lane"])
    await receiver.wait_for_ids(set(after), path="/held", timeout_s=30)
    assert set(delivered) == {*tripping, *held, *after}
    with system.api() as api:
        dead = api.get("/v1/dead-letters", params={"endpoint_id": endpoint["id"]}).json()["data"]
    assert dead == []
    delete(system, blocker)


async def test_a_held_endpoint_gets_a_queue_of_its_own_once_the_bound_has_room(
    system: System, receiver: Receiver
) -> None:
    """Held with its breaker open, then the endpoint that filled the bound is deleted: the leading
    monitor gives the held one the queue of its own it was refused (its reason still standing), and
    what it had waiting reaches it from there once it answers, none dead-lettered."""
    who = tenant()
    failing = {"now": True}

    def respond(request: Received) -> Reply:
        return Reply(status=500 if request.path == "/promoted" and failing["now"] else 204)

    receiver.responder = respond
    blocker = await take_the_bound(system, who, receiver)
    endpoint = system.add_endpoint(who, receiver.url("/promoted"), ["p.*"])
    tripping = await publish(system, who, "p.x", [f"evt_ptrip_{n}" for n in range(3)])

    await until_health(system, endpoint, breaker_state="open", held=True)
    waiting = await publish(system, who, "p.x", [f"evt_pwait_{n}" for n in range(3)])
    delete(system, blocker)

    await until_health(system, endpoint, held=False, isolation="breaker_open")
    isolated = logged([system.monitor], "endpoint_isolated", endpoint_id=endpoint["id"])
    assert [(entry["held"], entry["promoted"]) for entry in isolated] == [(True, False), (False, True)]
    assert await queue_exists(system.amqp_url, topology.endpoint_queue(endpoint["id"]))
    failing["now"] = False
    await receiver.wait_for_ids({*tripping, *waiting}, path="/promoted", timeout_s=90)
    with system.api() as api:
        dead = api.get("/v1/dead-letters", params={"endpoint_id": endpoint["id"]}).json()["data"]
    assert dead == []
