"""Per-endpoint flow control and ordering with three dispatcher replicas and real receivers.

Timing is read from what hookline recorded (the delivery log's attempts, the dispatchers' log lines):
when it sent each request and what it decided (a pause, a deferral), never from when requests reached
the receiver, which a busy machine shifts. Concurrency is what the receiver saw open at once.

And (from test_ordering_failover.py, on a system of its own with that module's settings): an ordered
endpoint's subject is never blocked for ever by an event another replica settled.

Order lives in the memory of the dispatcher that serves the endpoint (its queue has a single active
consumer). When that dispatcher loses the endpoint for a while and another one finishes an event it was
waiting for (a failover, or the breaker's probe), the first one still has the event as outstanding. It
used to defer every later event of that subject each second, for ever; now the event holds its subject
back only until ``HOOKLINE_ORDER_HOLD_S`` after it was due.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from support import broker as test_broker
from support import services
from support.amqp import event, publish_event
from support.deliverylog import Attempt, attempts_at, moment_s, sent_s
from support.logs import logged
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

# Ordering retries quickly; no breaker interferes with the deliberate failures.
SYSTEM_ENV = {"HOOKLINE_RETRY_SCHEDULE_S": "1", "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "1000"}


@pytest.fixture(scope="module", autouse=True)
def third_dispatcher(system: System) -> services.Service:
    return system.start_dispatcher("dispatcher-3")


async def test_max_in_flight_holds_across_three_replicas(system: System, receiver: Receiver) -> None:
    acme = tenant()
    # Each request is held until three are open at once, then 0.5 s more: the cap is reached whatever
    # the machine's speed, and a fourth request let through meanwhile would show.
    receiver.responder = lambda _: Reply(status=204, delay_s=0.5, hold_until_open=3)
    system.add_endpoint(acme, receiver.url("/capped"), ["#"], max_in_flight=3)
    ids = {f"evt_cap_{n}" for n in range(45)}
    for event_id in sorted(ids):
        await publish_event(system.amqp_url, event(acme, "a.b", event_id), f"{acme}.a.b")
    await receiver.wait_for_ids(ids, path="/capped", timeout_s=90)
    assert receiver.max_in_flight == 3, "the cap is reached and never exceeded"


async def test_the_rate_limit_holds_across_three_replicas(system: System, receiver: Receiver) -> None:
    acme = tenant()
    endpoint = system.add_endpoint(acme, receiver.url("/paced"), ["#"], rate_limit_per_s=2)
    ids = {f"evt_rate_{n}" for n in range(12)}
    for event_id in sorted(ids):
        await publish_event(system.amqp_url, event(acme, "a.b", event_id), f"{acme}.a.b")
    await receiver.wait_for_ids(ids, path="/paced", timeout_s=60)
    # When hookline sent each one (its own stamps): 2/s is a request every 0.5 s, whichever replica.
    attempts = await attempts_at(system, endpoint["id"], at_least=len(ids))
    assert {a["event_id"] for a in attempts} == ids
    sent = [sent_s(a) for a in attempts]
    busiest = max(sum(1 for t in sent if start <= t < start + 1.0) for start in sent)
    overall = (len(sent) - 1) / (sent[-1] - sent[0])
    # A one-second window holds two sends (one more if the dispatcher was held up for up to 0.5 s and
    # two went together after it); unpaced or paced per replica, all 12 would go within a second or two.
    assert busiest <= 3, f"{busiest} requests sent within one second: {_sends(attempts)}"
    assert overall <= 2 * 1.25, f"{overall:.2f}/s: {_sends(attempts)}"


async def test_a_429_slows_the_endpoint_down(system: System, receiver: Receiver) -> None:
    acme = tenant()
    replies = [Reply(status=429, headers={"Retry-After": "4"})]
    receiver.responder = lambda _: replies.pop(0) if replies else Reply(status=204)
    endpoint = system.add_endpoint(acme, receiver.url("/throttled"), ["#"], rate_limit_per_s=1)
    ids = [f"evt_throttle_{n}" for n in range(5)]
    await publish_event(system.amqp_url, event(acme, "a.b", ids[0]), f"{acme}.a.b")

    # The rest are published once the dispatcher has the 429 (its attempt line is written after it
    # paused the endpoint): each of them is then paced by that pause, however slow the machine is. (A
    # request already waiting for its turn when the 429 comes back is not held back again.)
    every = [*system.dispatchers, *system.extra]

    async def throttled() -> list[dict[str, Any]] | None:
        return logged(every, "delivery_attempt", endpoint_id=endpoint["id"], status=429) or None

    [line] = await eventually(throttled, timeout_s=30)
    for event_id in ids[1:]:
        await publish_event(system.amqp_url, event(acme, "a.b", event_id), f"{acme}.a.b")
    await receiver.wait_for_ids(set(ids), path="/throttled", timeout_s=60)

    attempts = await attempts_at(system, endpoint["id"], at_least=len(ids) + 1)
    [limited] = [a for a in attempts if a["status"] == 429]
    # What hookline decided: the endpoint paused for the Retry-After, and this event's retry after it too.
    paused_until_s = line["paused_until_s"]
    assert paused_until_s - moment_s(limited, "at") == pytest.approx(4.0, abs=0.002)
    assert moment_s(limited, "next_attempt_at") - moment_s(limited, "at") == pytest.approx(4.0, abs=0.002)
    # And did it: nothing was sent to the endpoint before the pause ended.
    early = [a for a in attempts if a is not limited and sent_s(a) < paused_until_s - 0.002]
    assert not early, f"sent during the pause (until {paused_until_s}): {_sends(early)}"
    assert {a["event_id"] for a in attempts if a["status"] == 204} == set(ids)


async def test_deliveries_already_waiting_when_a_429_comes_back_wait_for_its_pause(
    system: System, receiver: Receiver
) -> None:
    """Published together at 1/s: the first is answered 429 while the others wait for their turn (or
    for a connection); each is checked again right before it goes, so none is sent during the pause."""
    acme = tenant()
    # The 429 takes 1.5 s to come back: the others are waiting for their turn by then.
    replies = [Reply(status=429, headers={"Retry-After": "4"}, delay_s=1.5)]
    receiver.responder = lambda _: replies.pop(0) if replies else Reply(status=204)
    endpoint = system.add_endpoint(acme, receiver.url("/waiting"), ["#"], rate_limit_per_s=1)
    ids = [f"evt_waiting_{n}" for n in range(5)]
    await asyncio.gather(
        *(publish_event(system.amqp_url, event(acme, "a.b", event_id), f"{acme}.a.b") for event_id in ids)
    )
    await receiver.wait_for_ids(set(ids), path="/waiting", timeout_s=60)

    every = [*system.dispatchers, *system.extra]
    [line] = logged(every, "delivery_attempt", endpoint_id=endpoint["id"], status=429)
    paused_until_s = line["paused_until_s"]
    attempts = await attempts_at(system, endpoint["id"], at_least=len(ids) + 1)
    [limited] = [a for a in attempts if a["status"] == 429]
    early = [a for a in attempts if a is not limited and sent_s(a) < paused_until_s - 0.002]
    assert not early, f"sent during the pause (until {paused_until_s}): {_sends(early)}"
    assert {a["event_id"] for a in attempts if a["status"] == 204} == set(ids)


async def test_an_ordered_endpoint_keeps_each_subjects_order(system: System, receiver: Receiver) -> None:
    acme = tenant()
    failed_once: set[str] = set()

    def respond(request: Received) -> Reply:
        event_id = request.headers["webhook-id"]
        if event_id == "evt_s1_1" and event_id not in failed_once:
            failed_once.add(event_id)
            return Reply(status=500)  # the second event of s1 fails once
        return Reply(status=204)

    receiver.responder = respond
    endpoint = system.add_endpoint(acme, receiver.url("/ordered"), ["#"], ordered=True)
    for n in range(5):
        for subject in ("s1", "s2"):
            body = {**event(acme, "a.b", f"evt_{subject}_{n}"), "subject": subject}
            await publish_event(system.amqp_url, body, f"{acme}.a.b")
    await receiver.wait_for(11, path="/ordered", timeout_s=60)
    # A sentinel of a third subject, published last: a late or repeated delivery came before it.
    await publish_event(
        system.amqp_url, {**event(acme, "a.b", "evt_sentinel"), "subject": "s3"}, f"{acme}.a.b"
    )
    await receiver.wait_for_ids({"evt_sentinel"}, path="/ordered", timeout_s=30)

    def delivered(subject: str) -> list[str]:
        ok = [
            r for r in receiver.requests if r.path == "/ordered" and json.loads(r.body)["subject"] == subject
        ]
        ids = [r.headers["webhook-id"] for r in ok]
        return [i for n, i in enumerate(ids) if not (i == "evt_s1_1" and n == ids.index(i))]  # drop the 500

    assert delivered("s1") == [f"evt_s1_{n}" for n in range(5)], "s1 waited for its failed event"
    assert delivered("s2") == [f"evt_s2_{n}" for n in range(5)]
    # What the dispatchers decided: an event put off for its order waits for an earlier event of its own
    # subject, never for one of another (s1's failed event held back s1 alone).
    every = [*system.dispatchers, *system.extra]
    held = logged(every, "delivery_deferred", endpoint_id=endpoint["id"], reason="ordering")
    behind = {(line["event_id"], line["behind_event_id"]) for line in held}
    crossed = {(w, e) for w, e in behind if e is not None and _subject(w) != _subject(e)}
    assert not crossed, f"held back by another subject: {sorted(crossed)}"


def _sends(attempts: list[Attempt]) -> list[tuple[str, int, float]]:
    """What a failure message needs of attempts: the event, the attempt, when hookline sent it."""
    return [(a["event_id"], a["attempt"], round(sent_s(a), 3)) for a in attempts]


def _subject(event_id: str) -> str:
    return event_id.split("_")[1]  # evt_s1_3: s1


HOLD_S = 3
ORDERING_ENV = {
    "HOOKLINE_ORDER_HOLD_S": str(HOLD_S),
    # Long enough for the two rabbitmqctl calls below on a loaded machine (seconds each): the retry must
    # come after the connection is closed, or the dispatcher that failed it retries it itself.
    "HOOKLINE_RETRY_SCHEDULE_S": "8",
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "1000",
}


def ordered_event(tenant_name: str, event_id: str, subject: str) -> dict[str, object]:
    return {**event(tenant_name, "a.b", event_id), "subject": subject}


@pytest.mark.system_env(ORDERING_ENV)
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
