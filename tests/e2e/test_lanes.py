"""Lanes, with the real services: an endpoint with nothing to deliver costs the broker nothing of its own,
an event reaches a tenant's endpoints through one lane message, an endpoint just registered is never
skipped, and an endpoint that needs isolation (its breaker open) gets a queue of its own while it needs
one: its events wait there, none in its lane, and it goes back to its lane, its queue removed.

And (from test_holding.py, each test on a system of its own with that module's settings): past the bound
on queues of their own (here HOOKLINE_MAX_ENDPOINT_QUEUES=1, the one taken by an endpoint with a rate
limit, which has a queue of its own by its definition), an endpoint that needs isolation is held in a
shared holding lane, apart from the healthy lanes: its breaker's open time is waited out in the delay
queues, one queue write per copy per wait rather than a hand-back every second, and nothing is lost;
once the bound has room, it gets a queue of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import httpx
import orjson
import pytest
from support import services
from support.amqp import event, publish_event, queue_exists, read_stream
from support.broker import Broker
from support.logs import logged
from support.monitoring import counted, get_json, publish
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

from hookline.dispatcher.lanes import HELD_RECHECK_S
from hookline.shared.broker import topology
from hookline.shared.contracts import addressing
from hookline.shared.contracts.headers import Header

pytestmark = pytest.mark.e2e

SYSTEM_ENV = {
    "HOOKLINE_RETIRED_QUEUE_GRACE_S": "1",
    "HOOKLINE_QUEUE_POLL_S": "0.5",
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "3",
    "HOOKLINE_BREAKER_COOLDOWN_S": "2",
    "HOOKLINE_BREAKER_MAX_COOLDOWN_S": "4",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    "HOOKLINE_MAX_ATTEMPTS": "1000",
}


async def lane_messages(system: System) -> float:
    """Lane messages from ``events`` the dispatchers fanned out."""
    return await counted(system, 'hookline_lane_messages_total{kind="fan_out"}')


def ids_at(receiver: Receiver, path: str) -> Counter[str]:
    return Counter(r.headers["webhook-id"] for r in receiver.requests if r.path == path)


async def test_an_event_reaches_a_tenants_endpoints_through_one_lane_message(
    system: System, receiver: Receiver
) -> None:
    """Twenty endpoints of one tenant on the same events: each event is one lane message, fanned out by
    the dispatcher that takes it to all twenty, each getting it once; none of them has a queue."""
    who = tenant()
    endpoints = [system.add_endpoint(who, receiver.url(f"/fan{n}"), ["fan.*"]) for n in range(20)]
    before = await lane_messages(system)
    ids = await publish(system, who, "fan.out", [f"evt_fan_{n}" for n in range(10)])

    async def everyone_got_everything() -> bool:
        return all(set(ids_at(receiver, f"/fan{n}")) >= set(ids) for n in range(20))

    await eventually(everyone_got_everything, timeout_s=60)
    assert await lane_messages(system) - before == len(ids), "one lane message per event, not per endpoint"
    for n in range(20):
        assert ids_at(receiver, f"/fan{n}") == Counter(ids), f"/fan{n}: each event once"
    for endpoint in endpoints:
        assert not await queue_exists(system.amqp_url, topology.endpoint_queue(endpoint["id"]))


async def test_an_endpoint_just_registered_gets_the_next_event(system: System, receiver: Receiver) -> None:
    """Registered and, as soon as the API answers, an event published for it over AMQP: it arrives, with
    the tenant's pattern bound already (another endpoint has it) and with a new pattern, ten times over,
    whichever dispatcher takes the event (the answer waits until every one knows the endpoint)."""
    who = tenant()
    system.add_endpoint(who, receiver.url("/first"), ["known.*"])
    for n in range(10):
        pattern = "known.*" if n % 2 == 0 else f"new{n}.*"
        await asyncio.to_thread(system.add_endpoint, who, receiver.url(f"/new{n}"), [pattern])
        event_type = pattern.replace("*", "x")
        await publish(system, who, event_type, [f"evt_new_{n}"])
    for n in range(10):
        await receiver.wait_for_ids({f"evt_new_{n}"}, path=f"/new{n}", timeout_s=30)


async def test_an_open_breaker_holds_events_in_a_queue_of_its_own_then_back_to_the_lane(
    system: System, receiver: Receiver
) -> None:
    """An endpoint failing until its breaker opens: the leading monitor gives it a queue of its own
    first; what is published while the breaker is open waits there (no attempt, no trip through its
    lane), goes out once the probe succeeds, and the endpoint goes back to its lane, its queue removed
    once every dispatcher hands it nothing more."""
    who = tenant()
    failing = {"now": True}

    def respond(request: Received) -> Reply:
        return Reply(status=500 if failing["now"] and request.path == "/broken" else 204)

    receiver.responder = respond
    endpoint = system.add_endpoint(who, receiver.url("/broken"), ["b.*"])
    await publish(system, who, "b.x", [f"evt_trip_{n}" for n in range(3)])

    async def breaker(state: str) -> bool:
        health = await get_json(system.monitor, f"/v1/endpoints/{endpoint['id']}/health")
        return health is not None and health["breaker_state"] == state

    await eventually(lambda: breaker("open"), timeout_s=30)

    async def isolated_by_the_monitor() -> list[dict[str, Any]] | None:
        # The health view says open once the monitor decided it; it isolates the endpoint just after,
        # before it publishes the command (BreakerCommands.publish_commands), and that takes a queue
        # declare.
        return logged([system.monitor], "endpoint_isolated", endpoint_id=endpoint["id"]) or None

    [isolated] = await eventually(isolated_by_the_monitor, timeout_s=30)
    assert isolated["reason"] == "breaker_open"
    queue = topology.endpoint_queue(endpoint["id"])
    assert await queue_exists(system.amqp_url, queue)

    attempts_before = len(logged(system.dispatchers, "delivery_attempt", endpoint_id=endpoint["id"]))
    handed_back = 'hookline_handed_on_total{reason="breaker_open"}'
    hand_backs_before = await counted(system, handed_back)
    held = await publish(system, who, "b.x", [f"evt_held_{n}" for n in range(5)])

    async def waiting_in_its_queue() -> bool:
        health = await get_json(system.monitor, f"/v1/endpoints/{endpoint['id']}/health")
        return health is not None and (health["queue_depth"] or 0) >= len(held)

    await eventually(waiting_in_its_queue, timeout_s=30)
    # Nothing was attempted meanwhile (the probe aside), and none went round through its lane.
    assert (
        len(logged(system.dispatchers, "delivery_attempt", endpoint_id=endpoint["id"])) <= attempts_before + 1
    )
    assert await counted(system, handed_back) == hand_backs_before
    failing["now"] = False
    await receiver.wait_for_ids(set(held), path="/broken", timeout_s=60)
    await eventually(lambda: breaker("closed"), timeout_s=30)

    # Back in its lane, and its queue removed once drained and every dispatcher has applied that.
    async def removed() -> bool:
        return bool(logged([system.monitor], "queue_removed", endpoint_id=endpoint["id"]))

    await eventually(removed, timeout_s=60)
    assert logged([system.monitor], "endpoint_back_in_lane", endpoint_id=endpoint["id"])
    assert not await queue_exists(system.amqp_url, queue)
    after = await publish(system, who, "b.x", ["evt_after_lane"])
    await receiver.wait_for_ids(set(after), path="/broken", timeout_s=30)


async def test_a_fence_taken_before_its_deletion_is_known_goes_back_to_the_lane(
    system: System, receiver: Receiver
) -> None:
    """A dispatcher takes a deleted endpoint's fence before it has read the deletion (it follows the
    change log a moment behind): the fence goes back to the lane for a second, not into the endpoint's
    queue of its own, where it would wait behind the held events and be drained as a dead letter once
    the deletion is known, so that the fence never passed. Here the fence comes before the deletion, as
    the early dispatcher sees it, and the endpoint's breaker is open (its queue of its own holds)."""
    who = tenant()
    receiver.responder = lambda request: Reply(status=500 if request.path == "/fenced" else 204)
    endpoint = system.add_endpoint(who, receiver.url("/fenced"), ["f.*"])
    await publish(system, who, "f.x", [f"evt_fenced_{n}" for n in range(3)])

    async def isolated() -> bool:
        return bool(logged([system.monitor], "endpoint_isolated", endpoint_id=endpoint["id"]))

    await eventually(isolated, timeout_s=30)
    early = 'hookline_handed_on_total{reason="fence_early"}'
    before = await counted(system, early)
    connection = await aio_pika.connect(system.amqp_url)
    async with connection, connection.channel() as channel:
        fence = addressing.message(  # as the ingest builds it
            b"",
            event_id="fence_early_by_hand",
            endpoint_id=endpoint["id"],
            headers={Header.FENCE: endpoint["id"]},
        )
        await channel.default_exchange.publish(fence, routing_key=topology.lane_of(who))

    # Taken early again and again: it keeps coming back through the lane (held in the endpoint's queue,
    # it would have been taken once).
    async def came_back() -> bool:
        return await counted(system, early) >= before + 2

    await eventually(came_back, timeout_s=30)
    with system.api() as api:
        forced = await asyncio.to_thread(
            api.delete, f"/v1/endpoints/{endpoint['id']}", params={"force": "true"}
        )
        assert forced.status_code == 204

    async def passed() -> bool:
        return bool(logged(system.dispatchers, "endpoint_fence_passed", endpoint_id=endpoint["id"]))

    await eventually(passed, timeout_s=30)


async def test_a_lane_deleted_by_hand_is_declared_again_with_its_tenants_patterns(
    system: System, receiver: Receiver, rabbitmq: Broker
) -> None:
    """``rabbitmqctl delete_queue`` of a lane: the leading monitor finds it missing, declares it again
    and binds every pattern of the tenants in it; the dispatchers, whose consumers the broker cancelled,
    consume it again; events published afterwards are delivered."""
    who = tenant()
    system.add_endpoint(who, receiver.url("/relaned"), ["r.*"])
    await receiver.wait_for_ids(
        set(await publish(system, who, "r.x", ["evt_before_lane_loss"])), path="/relaned"
    )
    vhost = unquote(urlsplit(system.amqp_url).path.lstrip("/"))
    await rabbitmq.ctl_async(["delete_queue", "-p", vhost, topology.lane_of(who)])

    async def bound_again() -> bool:
        return bool(logged([system.monitor], "lanes_bound_again"))

    await eventually(bound_again, timeout_s=30)

    async def consumed_again() -> bool:
        return len(logged(system.dispatchers, "lane_attached", queue=topology.lane_of(who))) >= 2

    await eventually(consumed_again, timeout_s=30)
    after = await publish(system, who, "r.x", ["evt_after_lane_loss"])
    await receiver.wait_for_ids(set(after), path="/relaned", timeout_s=30)


async def test_a_dispatcher_killed_in_the_middle_of_fan_outs_loses_nothing(
    own_system: System, receiver: Receiver
) -> None:
    """Ten endpoints of one tenant on the same events, one of them answering slowly, so that lane
    messages are in the middle of their fan-out (some copies delivered, others not) when both
    dispatchers are SIGKILLed: the broker gives the lane messages out again, a new dispatcher fans them
    out again, and every endpoint gets every event (those done before the kill twice: at least once)."""
    system = own_system
    who = tenant()

    def respond(request: Received) -> Reply:
        return Reply(delay_s=1.5 if request.path == "/mid9" else 0.0)  # under the slow line (2 s)

    receiver.responder = respond
    for n in range(10):
        system.add_endpoint(who, receiver.url(f"/mid{n}"), ["mid.*"])
    ids = await publish(system, who, "mid.x", [f"evt_mid_{n}" for n in range(30)])

    async def some_done_some_not() -> bool:
        fast = set(ids_at(receiver, "/mid0"))
        slow = set(ids_at(receiver, "/mid9"))
        return len(fast) >= 5 and len(slow) < len(ids)

    await eventually(some_done_some_not, timeout_s=30, every_s=0.05)
    for dispatcher in system.dispatchers:
        dispatcher.kill()  # SIGKILL: no drain, no acks
    system.start_dispatcher("dispatcher-after-kill")
    for n in range(10):
        await receiver.wait_for_ids(set(ids), path=f"/mid{n}", timeout_s=60)


async def test_a_batch_of_endpoints_is_created_at_once_and_each_gets_the_next_event(
    system: System, receiver: Receiver
) -> None:
    """``POST /v1/endpoints/batch``: a result per item in order (one refused, the rest created), answered
    once every dispatcher knows them all: an event published right after reaches each."""
    tenants = [tenant() for _ in range(5)]
    items: list[dict[str, object]] = [
        {"tenant": tenants[n % 5], "url": receiver.url(f"/batch{n}"), "event_types": ["b.*"], "verify": False}
        for n in range(40)
    ]
    items.insert(7, {"tenant": tenants[0], "url": "ftp://nowhere", "event_types": ["b.*"], "verify": False})
    async with httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=60
    ) as api:
        answer = await api.post("/v1/endpoints/batch", json={"endpoints": items})
    assert answer.status_code == 200, answer.text
    results = answer.json()["results"]
    assert [r["index"] for r in results] == list(range(41))
    assert [r["status"] for r in results] == [201] * 7 + [422] + [201] * 33
    assert results[7]["error"] == "invalid_fields"
    assert all(r["endpoint"]["secret"].startswith("whsec_") for r in results if r["status"] == 201)
    # Written as one record of the change log, not one each.
    created = {r["endpoint"]["id"] for r in results if r["status"] == 201}
    records = await read_stream(system.amqp_url, topology.ENDPOINT_LOG, idle_s=0.3)
    batches = [
        [upsert["endpoint"]["id"] for upsert in body["upserts"]]
        for body in (orjson.loads(m.body) for m in records if m.body.startswith(b"{"))
        if body["kind"] == "endpoints.upserted" and created & {u["endpoint"]["id"] for u in body["upserts"]}
    ]
    assert [set(ids) for ids in batches] == [created]
    # Each in the audit trail (one message holds them all), paged through in the batch's order.
    first_tenants = [
        r["endpoint"]["id"] for r in results if r["status"] == 201 and r["endpoint"]["tenant"] == tenants[0]
    ]

    async def audited() -> list[str] | None:
        seen: list[str] = []
        after: dict[str, str] = {}
        async with httpx.AsyncClient(
            base_url=system.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=30
        ) as api:
            while True:
                page = (await api.get("/v1/audit", params={"tenant": tenants[0], "limit": 3, **after})).json()
                seen += [r["target"] for r in page["data"] if r["action"] == "endpoint.created"]
                if page["next_after"] is None:
                    return seen if len(seen) >= len(first_tenants) else None
                after = {"after": page["next_after"]}

    assert await eventually(audited, timeout_s=20) == first_tenants
    for who in tenants:
        await publish(system, who, "b.x", [f"evt_batch_{who}"])
    for n in range(40):
        await receiver.wait_for_ids({f"evt_batch_{tenants[n % 5]}"}, path=f"/batch{n}", timeout_s=30)


async def test_an_ordered_endpoint_takes_its_events_straight_from_events(
    system: System, receiver: Receiver
) -> None:
    """An ordered endpoint's queue of its own is bound to ``events`` from its creation: none of its
    events passes through its lane (taken by every dispatcher, two of them each handing on one of two
    events of a subject could swap them), even beside an endpoint of its tenant on an overlapping
    pattern, which keeps the lane bound; each reaches it once, in order. Its patterns changed, the new
    one reaches its queue and the old one no more; no longer ordered, it is back on its lane, and every
    event reaches it once."""
    who = tenant()
    ordered = system.add_endpoint(who, receiver.url("/straight"), ["o.*"], ordered=True)
    system.add_endpoint(who, receiver.url("/beside"), ["#"])
    handed_on = 'hookline_handed_on_total{reason="isolated"}'
    unsubscribed = "hookline_unsubscribed_copies_total"
    handed_on_before = await counted(system, handed_on)
    ids = [f"evt_straight_{n}" for n in range(20)]
    for event_id in ids:
        body = {**event(who, "o.x", event_id), "subject": "s"}
        await publish_event(system.amqp_url, body, f"{who}.o.x")
    await receiver.wait_for_ids(set(ids), path="/beside", timeout_s=60)
    await receiver.wait_for_ids(set(ids), path="/straight", timeout_s=60)
    assert await counted(system, handed_on) == handed_on_before, "its events came through its lane"
    straight = [r.headers["webhook-id"] for r in receiver.requests if r.path == "/straight"]
    assert straight == ids

    # Its patterns changed: an event of the pattern it dropped, then one of the new (last: the other,
    # had its queue still been bound for it, came first and was counted).
    with system.api() as api:
        changed = api.patch(f"/v1/endpoints/{ordered['id']}", json={"event_types": ["p.*"]})
        assert changed.status_code == 200, changed.text
    unsubscribed_before = await counted(system, unsubscribed)
    await publish(system, who, "o.x", ["evt_dropped"])
    await publish(system, who, "p.x", ["evt_new_pattern"])
    await receiver.wait_for_ids({"evt_new_pattern"}, path="/straight", timeout_s=30)
    await receiver.wait_for_ids({"evt_dropped", "evt_new_pattern"}, path="/beside", timeout_s=30)
    assert "evt_dropped" not in ids_at(receiver, "/straight")
    assert await counted(system, unsubscribed) == unsubscribed_before, "still bound for the dropped pattern"

    # No longer ordered: back on its lane, from the next event on, each once.
    with system.api() as api:
        changed = api.patch(f"/v1/endpoints/{ordered['id']}", json={"ordered": False})
        assert changed.status_code == 200, changed.text
    laned = await publish(system, who, "p.x", [f"evt_laned_{n}" for n in range(10)])
    await receiver.wait_for_ids(set(laned), path="/straight", timeout_s=60)
    sentinel = await publish(system, who, "p.x", ["evt_laned_sentinel"])
    await receiver.wait_for_ids(set(sentinel), path="/straight", timeout_s=30)
    counts = ids_at(receiver, "/straight")
    assert {event_id: counts[event_id] for event_id in laned} == dict.fromkeys(laned, 1)


async def test_an_endpoint_made_ordered_leaves_its_lane_and_loses_nothing(
    system: System, receiver: Receiver
) -> None:
    """A laned endpoint made ordered while events of one subject flow: its queue is bound to ``events``,
    then a fence goes through its lane, and the dispatcher that takes it writes it off its lane. Every event published before, during and after reaches it; those published
    after the answer first reach it in the order they were published (a lane copy from the switch may
    come again later: at least once)."""
    who = tenant()
    endpoint = system.add_endpoint(who, receiver.url("/made-ordered"), ["o.*"])
    system.add_endpoint(who, receiver.url("/beside"), ["#"])  # keeps the lane bound for its events

    async def flow(ids: list[str]) -> None:
        for event_id in ids:
            await publish_event(
                system.amqp_url, {**event(who, "o.x", event_id), "subject": "s"}, f"{who}.o.x"
            )

    during = [f"evt_switch_{n}" for n in range(60)]
    publishing = asyncio.create_task(flow(during))
    await receiver.wait_for_ids(set(during[:5]), path="/made-ordered", timeout_s=60)
    with system.api() as api:
        made = await asyncio.to_thread(api.patch, f"/v1/endpoints/{endpoint['id']}", json={"ordered": True})
    assert made.status_code == 200, made.text
    assert made.json()["ordered"] is True
    await publishing
    after = [f"evt_ordered_{n}" for n in range(20)]
    await flow(after)
    await receiver.wait_for_ids({*during, *after}, path="/made-ordered", timeout_s=90)
    first_seen = list(
        dict.fromkeys(r.headers["webhook-id"] for r in receiver.requests if r.path == "/made-ordered")
    )
    assert [event_id for event_id in first_seen if event_id in after] == after

    def left() -> list[dict[str, object]]:
        return logged(system.dispatchers, "endpoint_fence_passed", endpoint_id=endpoint["id"], verdict="left")

    await eventually(lambda: asyncio.sleep(0, bool(left())), timeout_s=30)
    assert len(left()) == 1, "its lane's fence passed once, and it left its lane"


COOLDOWN_S = 8
HOLDING_ENV = {
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


@pytest.mark.system_env(HOLDING_ENV)
async def test_an_endpoint_held_past_the_bound_waits_out_its_breaker_and_loses_nothing(
    own_system: System, receiver: Receiver
) -> None:
    """Failing until its breaker opens: the monitor holds it (no queue of its own can be had); what is
    published while the breaker is open is not attempted (the probe aside), waits in the delay queues
    until the probe is due, and never passes through a healthy lane; its healthy neighbour gets every
    event meanwhile; once it answers again, every event reaches it, none is dead-lettered, and it goes
    back to its lane."""
    system = own_system  # the settings of its own (system_env)
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


@pytest.mark.system_env(HOLDING_ENV)
async def test_a_held_endpoint_gets_a_queue_of_its_own_once_the_bound_has_room(
    own_system: System, receiver: Receiver
) -> None:
    """Held with its breaker open, then the endpoint that filled the bound is deleted: the leading
    monitor gives the held one the queue of its own it was refused (its reason still standing), and
    what it had waiting reaches it from there once it answers, none dead-lettered."""
    system = own_system  # the settings of its own (system_env)
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
