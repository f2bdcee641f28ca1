"""Slow endpoints cannot take a dispatcher's connections from the endpoints that answer, and waiting for
one of hookline's own connections never counts against an attempt's timeout.

Each dispatcher here has four attempt slots (one of them the slow share) and finds an endpoint slow
after half a second: scaled down from 512 and 2 s, the same proportions as the defaults; it holds 16
messages of a lane and delivers two of an endpoint's at once (256 and 32 by default).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from support.amqp import event, publish_events_at_once
from support.logs import logged
from support.monitoring import counted, get_json, publish
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

SYSTEM_ENV = {
    "HOOKLINE_HTTP_MAX_CONNECTIONS": "4",
    "HOOKLINE_SLOW_SHARE": "0.25",
    "HOOKLINE_SLOW_ATTEMPT_S": "0.5",
    "HOOKLINE_LANE_PREFETCH": "16",
    "HOOKLINE_PREFETCH_PER_ENDPOINT": "2",
}
SLOW_ANSWER_S = 1.2


async def attempts_of(system: System, endpoint_id: str) -> list[dict[str, Any]]:
    page = await get_json(system.ingest, f"/v1/endpoints/{endpoint_id}/attempts", limit="500")
    return [] if page is None else list(page["data"])


async def test_slow_endpoints_do_not_make_the_others_time_out(system: System, receiver: Receiver) -> None:
    """Four endpoints that answer after 1.2 s would fill both dispatchers' four connections many times
    over (32 deliveries each held per dispatcher); an endpoint beside them whose timeout is 1 s gets
    every event on its first attempt, none of them timed out waiting for a connection."""

    def respond(request: Received) -> Reply:
        return Reply(delay_s=SLOW_ANSWER_S) if request.path.startswith("/slow") else Reply()

    receiver.responder = respond
    who = tenant()
    slow = [system.add_endpoint(who, receiver.url(f"/slow{n}"), ["tick.*"]) for n in range(4)]
    healthy = system.add_endpoint(who, receiver.url("/healthy"), ["tick.*"], timeout_s=1)
    ids = await publish(system, who, "tick.now", [f"evt_iso_{n}" for n in range(8)])

    async def healthy_got_all() -> bool:
        got = {r.headers["webhook-id"] for r in receiver.requests if r.path == "/healthy"}
        return got >= set(ids)

    await eventually(healthy_got_all, timeout_s=60)

    async def all_recorded() -> list[dict[str, Any]] | None:
        attempts = await attempts_of(system, healthy["id"])
        return attempts if {a["event_id"] for a in attempts} >= set(ids) else None

    attempts = await eventually(all_recorded)
    failed = [(a["event_id"], a["outcome"], a.get("error")) for a in attempts if a["outcome"] != "success"]
    assert failed == [], "a healthy endpoint's attempt failed beside slow ones"
    # At least once: a lane message given out again (its replica lost its channel under load) is sent
    # again, a second attempt of its own; what must never be is one attempt listed twice.
    listed = [(a["event_id"], a["dispatcher_id"], a["at"]) for a in attempts]
    assert len(listed) == len(set(listed)), "an attempt listed twice"
    assert {a["event_id"] for a in attempts} == set(ids)

    # The slow ones are served too, within their share (nothing is lost or dropped for them).
    async def slow_served() -> bool:
        got = [r.headers["webhook-id"] for r in receiver.requests if r.path.startswith("/slow")]
        return len(set(got)) == len(ids) and all(
            {r.headers["webhook-id"] for r in receiver.requests if r.path == f"/slow{n}"} == set(ids)
            for n in range(len(slow))
        )

    await eventually(slow_served, timeout_s=120, every_s=1)

    # Each slow endpoint stands slow on the dispatchers that served it, and says so in /metrics.
    async with httpx.AsyncClient(timeout=10) as client:
        texts = [(await client.get(f"{d.base_url}/metrics")).text for d in system.dispatchers]
    slow_counts = [
        float(line.split()[-1])
        for text in texts
        for line in text.splitlines()
        if line.startswith("hookline_dispatcher_slow_endpoints ")
    ]
    assert sum(slow_counts) >= len(slow), slow_counts
    # And each was given a queue of its own (an attempt from the lane cut at the slow line, or its
    # copies waiting there for a connection, handed there): the lane's other endpoints never waited
    # behind them.
    isolated = {r["endpoint_id"]: r["reason"] for r in logged(system.dispatchers, "endpoint_isolated")}
    assert {endpoint["id"] for endpoint in slow} <= set(isolated), isolated
    assert {isolated[endpoint["id"]] for endpoint in slow} <= {"slow", "backlogged"}


async def test_a_replica_busy_with_answering_endpoints_isolates_none_of_them(
    system: System, receiver: Receiver
) -> None:
    """Forty endpoints of a tenant, one event, answers in 0.15 s: the dispatcher that fans it out has
    three answering slots, so most copies wait for one longer than the slow line (0.5 s). The replica is
    busy, not the endpoints slow: none is isolated as backlogged (each would be a change-log record and
    a second queue write for nothing, twenty thousand at once when a bench saturated one receiver host),
    and every endpoint gets the event."""

    def respond(request: Received) -> Reply:
        return Reply(delay_s=0.15) if request.path.startswith("/busy") else Reply()

    receiver.responder = respond
    who = tenant()
    endpoints = [system.add_endpoint(who, receiver.url(f"/busy{n}"), ["busy.*"]) for n in range(40)]
    [event_id] = await publish(system, who, "busy.now", ["evt_busy"])

    async def everyone_got_it() -> bool:
        got = {r.path for r in receiver.requests if r.headers.get("webhook-id") == event_id}
        return got >= {f"/busy{n}" for n in range(40)}

    await eventually(everyone_got_it, timeout_s=60)
    assert isolated_as(system, "backlogged", {endpoint["id"] for endpoint in endpoints}) == []


def isolated_as(system: System, reason: str, ids: set[str]) -> list[str]:
    return [
        line["endpoint_id"]
        for line in logged(system.dispatchers, "endpoint_isolated")
        if line["endpoint_id"] in ids and line["reason"] == reason
    ]


async def test_a_burst_to_one_endpoint_is_moved_off_its_lane(system: System, receiver: Receiver) -> None:
    """Sixty events at once to one endpoint that answers in 50 ms: two of its copies go at a time on
    each dispatcher, the others wait for their turn and are all that waits from the tenant's lane, so
    they hold the lane: the endpoint is backlogged, gets a queue of its own, and the burst leaves the
    lane; its neighbour (the same tenant, another type) gets its event, and the burst arrives whole.
    The monitor then binds its queue to ``events`` directly: the next sixty never pass through the lane."""

    def respond(request: Received) -> Reply:
        return Reply(delay_s=0.05) if request.path == "/burst" else Reply()

    receiver.responder = respond
    who = tenant()
    burst = system.add_endpoint(who, receiver.url("/burst"), ["burst.*"])
    system.add_endpoint(who, receiver.url("/calm"), ["calm.*"])
    ids = [f"evt_burst_{n}" for n in range(60)]
    await publish_events_at_once(system.amqp_url, [event(who, "burst.go", i) for i in ids], f"{who}.burst.go")

    async def isolated() -> bool:
        return isolated_as(system, "backlogged", {burst["id"]}) != []

    await eventually(isolated, timeout_s=30)
    [calm_id] = await publish(system, who, "calm.go", ["evt_calm"])

    async def delivered() -> bool:
        return calm_id in ids_at(receiver, "/calm") and set(ids_at(receiver, "/burst")) == set(ids)

    await eventually(delivered, timeout_s=60)

    async def routed_directly() -> bool:
        health = await get_json(system.monitor, f"/v1/endpoints/{burst['id']}/health")
        return health is not None and health["routed_directly"] is True

    await eventually(routed_directly, timeout_s=30)
    assert any(
        line["endpoint_id"] == burst["id"] for line in logged([system.monitor], "endpoint_routed_directly")
    )
    fanned_out = await counted(system, 'hookline_lane_messages_total{kind="fan_out"}')
    more = [f"evt_burst_more_{n}" for n in range(60)]
    await publish_events_at_once(
        system.amqp_url, [event(who, "burst.go", i) for i in more], f"{who}.burst.go"
    )
    [sentinel] = await publish(system, who, "calm.go", ["evt_calm_after"])

    async def all_delivered() -> bool:
        return sentinel in ids_at(receiver, "/calm") and set(ids_at(receiver, "/burst")) >= set(more)

    await eventually(all_delivered, timeout_s=60)
    # The sentinel is the one lane message since (the burst went straight to the queue of its own).
    assert await counted(system, 'hookline_lane_messages_total{kind="fan_out"}') - fanned_out == 1


async def test_a_load_spread_over_a_tenants_endpoints_isolates_none_of_them(
    system: System, receiver: Receiver
) -> None:
    """Six endpoints of a tenant each get the same thirty events at once (a lane message each, fanned
    out to all six) and answer in 0.1 s: their copies wait for their turn far past the backlog line, and
    for the three answering slots, but each endpoint waits its share of its lane and holds its share of
    the slots. Nobody is behind anybody: none is isolated (a queue of its own each would only write
    every event twice), and every endpoint gets every event."""

    def respond(request: Received) -> Reply:
        return Reply(delay_s=0.1) if request.path.startswith("/spread") else Reply()

    receiver.responder = respond
    who = tenant()
    endpoints = [system.add_endpoint(who, receiver.url(f"/spread{n}"), ["spread.*"]) for n in range(6)]
    ids = [f"evt_spread_{n}" for n in range(30)]
    await publish_events_at_once(
        system.amqp_url, [event(who, "spread.go", i) for i in ids], f"{who}.spread.go"
    )

    async def everyone_got_everything() -> bool:
        return all(set(ids_at(receiver, f"/spread{n}")) == set(ids) for n in range(6))

    await eventually(everyone_got_everything, timeout_s=60)
    spread = {endpoint["id"] for endpoint in endpoints}
    assert isolated_as(system, "backlogged", spread) == []
    assert isolated_as(system, "slow", spread) == []


def ids_at(receiver: Receiver, path: str) -> set[str]:
    return {r.headers["webhook-id"] for r in receiver.requests if r.path == path}
