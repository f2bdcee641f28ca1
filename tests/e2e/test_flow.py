"""Per-endpoint flow control and ordering with three dispatcher replicas and real receivers."""

from __future__ import annotations

import json

import pytest
from support import services
from support.amqp import event, publish_event
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant

# Rates, concurrency caps and Retry-After pauses measured in wall time: alone, not beside another module.
pytestmark = [pytest.mark.e2e, pytest.mark.serial]

# Ordering retries quickly; no breaker interferes with the deliberate failures.
SYSTEM_ENV = {"HOOKLINE_RETRY_SCHEDULE_S": "1", "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "1000"}


@pytest.fixture(scope="module", autouse=True)
def third_dispatcher(system: System) -> services.Service:
    return system.start_dispatcher("dispatcher-3")


async def test_max_in_flight_holds_across_three_replicas(system: System, receiver: Receiver) -> None:
    acme = tenant()
    receiver.responder = lambda _: Reply(status=204, delay_s=0.2)
    system.add_endpoint(acme, receiver.url("/capped"), ["#"], max_in_flight=3)
    for n in range(45):
        await publish_event(system.amqp_url, event(acme, "a.b", f"evt_cap_{n}"), f"{acme}.a.b")
    await receiver.wait_for(45, path="/capped", timeout_s=60)
    assert receiver.max_in_flight == 3, "the cap is reached and never exceeded"


async def test_the_rate_limit_holds_across_three_replicas(system: System, receiver: Receiver) -> None:
    acme = tenant()
    system.add_endpoint(acme, receiver.url("/paced"), ["#"], rate_limit_per_s=10)
    for n in range(40):
        await publish_event(system.amqp_url, event(acme, "a.b", f"evt_rate_{n}"), f"{acme}.a.b")
    arrivals = [r.at for r in await receiver.wait_for(40, path="/paced", timeout_s=60)]
    busiest = max(sum(1 for t in arrivals if start <= t < start + 1.0) for start in arrivals)
    overall = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    assert busiest <= 11, f"{busiest} deliveries within one second"
    assert 8 <= overall <= 10.5, overall


async def test_a_429_slows_the_endpoint_down(system: System, receiver: Receiver) -> None:
    acme = tenant()
    replies = [Reply(status=429, headers={"Retry-After": "2"})]
    receiver.responder = lambda _: replies.pop(0) if replies else Reply(status=204)
    # 1/s: the second request is due a second after the first, long after its 429 is known (at 50/s it
    # was due 20 ms later, and on a loaded machine it left before the 429 came back).
    system.add_endpoint(acme, receiver.url("/throttled"), ["#"], rate_limit_per_s=1)
    for n in range(5):
        await publish_event(system.amqp_url, event(acme, "a.b", f"evt_throttle_{n}"), f"{acme}.a.b")
    arrivals = await receiver.wait_for(6, path="/throttled", timeout_s=30)
    first = arrivals[0].at
    assert all(r.at - first >= 2.0 - 0.05 for r in arrivals[1:]), "nothing goes out before Retry-After"


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
    system.add_endpoint(acme, receiver.url("/ordered"), ["#"], ordered=True)
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
    s2_done = max(r.at for r in receiver.requests if r.headers["webhook-id"] == "evt_s2_4")
    s1_retry = max(r.at for r in receiver.requests if r.headers["webhook-id"] == "evt_s1_1")
    assert s2_done < s1_retry, "the other subject was not held back"
