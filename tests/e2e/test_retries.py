"""Failure handling, end to end: retries through the delay queues, dead letters, redrive and replay;
faults that lose nothing: a dispatcher killed mid-work, endpoints that hang or drop the connection.

The services run with HOOKLINE_RETRY_SCHEDULE_S=1,2 and no jitter (tests shrink the schedule through
settings), so the delays between attempts are exactly 1 s, then 2 s, 2 s, ...

And (from test_lost_frames.py, each of those tests on a system of its own): a word lost between a
dispatcher and the broker: the broker's cancel of a consumer, or the dispatcher's ack of a message it
settled. One dispatcher reaches the broker through a TCP proxy that the test controls (the system's own
two are stopped); the other services connect directly.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from standardwebhooks.webhooks import Webhook
from support import services
from support.amqp import event, publish_event
from support.broker import Broker
from support.deliverylog import assert_retried_after, attempts_of
from support.logs import logged
from support.monitoring import publish
from support.proxy import TcpProxy
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e


def dead_letters(system: System, **filters: str) -> list[dict[str, Any]]:
    with system.api() as api:
        response = api.get("/v1/dead-letters", params={**filters, "limit": 1000})
    assert response.status_code == 200, response.text
    items: list[dict[str, Any]] = response.json()["data"]
    return items


async def wait_dead(system: System, count: int, **filters: str) -> list[dict[str, Any]]:
    async def probe() -> list[dict[str, Any]] | None:
        found = await asyncio.to_thread(dead_letters, system, **filters)
        return found if len(found) >= count else None

    return await eventually(probe)


def scripted(*replies: Reply) -> Any:
    remaining = list(replies)
    return lambda _: remaining.pop(0) if remaining else Reply(status=204)


async def test_failing_n_times_then_succeeding_gives_n_plus_one_attempts(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    receiver.responder = scripted(Reply(status=500), Reply(status=503), Reply(status=408), Reply(status=204))
    endpoint = system.add_endpoint(acme, receiver.url("/flaky"), ["#"])
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_flaky_1"), f"{acme}.a.b")

    attempts = await receiver.wait_for(4, path="/flaky", timeout_s=30)
    # A sentinel, published after the last attempt: an attempt too many would come before it.
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_sentinel"), f"{acme}.a.b")
    await receiver.wait_for_ids({"evt_sentinel"}, path="/flaky", timeout_s=30)
    attempts = [r for r in receiver.requests if r.headers["webhook-id"] != "evt_sentinel"]
    assert len(attempts) == 4, "exactly N + 1 attempts"
    assert {r.headers["webhook-id"] for r in attempts} == {"evt_flaky_1"}
    assert len({r.body for r in attempts}) == 1, "the body is identical on every attempt"
    assert len({r.headers["webhook-signature"] for r in attempts}) == 4, "each attempt is signed afresh"
    for attempt in attempts:
        Webhook(endpoint["secret"]).verify(attempt.body, attempt.headers)
    # The schedule as hookline applied it: each failure's next attempt due 1 s, then 2 s, 2 s after it
    # (no jitter here), and no attempt sent before it was due (by hookline's own stamps).
    logged = await attempts_of(system, "evt_flaky_1", endpoint["id"], at_least=4)
    assert [(a["attempt"], a["status"]) for a in logged] == [(1, 500), (2, 503), (3, 408), (4, 204)]
    assert_retried_after(logged, [1, 2, 2])
    assert dead_letters(system, endpoint_id=endpoint["id"]) == []


async def test_retry_after_on_429_is_honoured(system: System, receiver: Receiver) -> None:
    acme = tenant()
    receiver.responder = scripted(Reply(status=429, headers={"Retry-After": "3"}))
    endpoint = system.add_endpoint(acme, receiver.url("/limited"), ["#"])
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_limited_1"), f"{acme}.a.b")
    await receiver.wait_for(2, path="/limited", timeout_s=30)
    logged = await attempts_of(system, "evt_limited_1", endpoint["id"], at_least=2)
    assert [a["status"] for a in logged] == [429, 204]
    assert_retried_after(logged, [3])  # Retry-After, not the schedule's 1 s


async def test_a_400_is_dead_lettered_at_once(system: System, receiver: Receiver) -> None:
    acme = tenant()
    receiver.responder = lambda _: Reply(status=400)
    endpoint = system.add_endpoint(acme, receiver.url("/refuses"), ["#"])
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_refused_1"), f"{acme}.a.b")
    [item] = await wait_dead(system, 1, endpoint_id=endpoint["id"])
    assert (item["reason"], item["last_status"], item["attempts"], item["event_id"], item["tenant"], item["type"]) == (
        "permanent_status", 400, 1, "evt_refused_1", acme, "a.b",
    )  # fmt: skip
    assert item["last_error"].startswith("HTTP 400")
    assert len(receiver.requests) == 1


async def test_a_410_disables_the_endpoint_until_it_is_resumed(system: System, receiver: Receiver) -> None:
    acme = tenant()
    receiver.responder = scripted(Reply(status=410))
    endpoint = system.add_endpoint(acme, receiver.url("/gone"), ["#"])
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_gone_1"), f"{acme}.a.b")
    [item] = await wait_dead(system, 1, endpoint_id=endpoint["id"])
    assert (item["reason"], item["last_status"]) == ("endpoint_gone", 410)

    def status() -> str:
        with system.api() as api:
            return str(api.get(f"/v1/endpoints/{endpoint['id']}").json()["status"])

    async def disabled() -> bool:
        return await asyncio.to_thread(status) == "disabled"

    await eventually(disabled)
    # While disabled, events wait in the queue and nothing is attempted.
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_gone_2"), f"{acme}.a.b")
    await eventually(lambda: asyncio.to_thread(lambda: _state(system, "evt_gone_2") == ["disabled"]))
    assert len(receiver.requests) == 1
    assert "endpoint_disabled" in system.logs()
    with system.api() as api:
        assert api.post(f"/v1/endpoints/{endpoint['id']}/resume").json()["status"] == "active"
    [_, resumed] = await receiver.wait_for(2, path="/gone")
    assert resumed.headers["webhook-id"] == "evt_gone_2"


async def test_exhausted_attempts_are_dead_letters_that_redrive_delivers(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    failing = True
    receiver.responder = lambda _: Reply(status=500 if failing else 204)
    endpoint = system.add_endpoint(acme, receiver.url("/exhausted"), ["a.b"], max_attempts=2)
    other = system.add_endpoint(acme, receiver.url("/other"), ["x.y"], max_attempts=1)
    for n in range(3):
        await publish_event(system.amqp_url, event(acme, "a.b", f"evt_exhausted_{n}"), f"{acme}.a.b")
    await publish_event(system.amqp_url, event(acme, "x.y", "evt_other_1"), f"{acme}.x.y")

    items = await wait_dead(system, 3, endpoint_id=endpoint["id"])
    assert {item["event_id"] for item in items} == {f"evt_exhausted_{n}" for n in range(3)}
    assert {(item["reason"], item["attempts"], item["last_status"]) for item in items} == {
        ("max_attempts", 2, 500)
    }
    assert len(await wait_dead(system, 1, endpoint_id=other["id"])) == 1
    assert len(dead_letters(system, tenant=acme, reason="max_attempts")) == 4
    assert dead_letters(system, tenant=acme, reason="invalid_event") == []
    assert len([r for r in receiver.requests if r.path == "/exhausted"]) == 6

    failing = False
    with system.api() as api:
        assert api.post("/v1/dead-letters/redrive", json={}).status_code == 422, "redrive needs a choice"
        one = api.post("/v1/dead-letters/redrive", json={"event_id": "evt_exhausted_0"}).json()
        rest = api.post("/v1/dead-letters/redrive", json={"endpoint_id": endpoint["id"]}).json()
    assert (one["redriven"], rest["redriven"]) == (1, 2)
    redelivered = await receiver.wait_for(9, path="/exhausted")
    assert sorted(r.headers["webhook-id"] for r in redelivered[6:]) == [
        f"evt_exhausted_{n}" for n in range(3)
    ]
    # Redriven dead letters are no longer listed; the other endpoint's still is.
    assert dead_letters(system, endpoint_id=endpoint["id"]) == []
    assert len(dead_letters(system, endpoint_id=other["id"])) == 1


async def test_replay_resends_a_window_with_the_original_ids(system: System, receiver: Receiver) -> None:
    acme, other = tenant(), tenant()
    endpoint = system.add_endpoint(acme, receiver.url("/replayed"), ["order.*"])
    before = datetime.now(UTC)
    with system.api() as api:
        for n in range(3):
            api.post(
                "/v1/events",
                json={"id": f"evt_replay_{n}", "tenant": acme, "type": "order.created", "data": {}},
            )
        api.post(
            "/v1/events",
            json={"id": "evt_replay_invoice", "tenant": acme, "type": "invoice.paid", "data": {}},
        )
        api.post(
            "/v1/events",
            json={"id": "evt_replay_other", "tenant": other, "type": "order.created", "data": {}},
        )
    await publish_event(
        system.amqp_url, event(acme, "order.updated", "evt_replay_amqp"), f"{acme}.order.updated"
    )
    first_pass = await receiver.wait_for(4, path="/replayed")
    with system.api() as api:
        late = api.post(
            "/v1/events", json={"id": "evt_replay_late", "tenant": acme, "type": "order.created", "data": {}}
        ).json()
    await receiver.wait_for(5, path="/replayed")
    # The window ends just before hookline accepted the late event (its own stamp, to the millisecond).
    until = datetime.fromisoformat(late["accepted_at"]) - timedelta(milliseconds=1)

    with system.api() as api:
        answer = api.post(
            f"/v1/endpoints/{endpoint['id']}/replay",
            json={"since": (before - timedelta(seconds=1)).isoformat(), "until": until.isoformat()},
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["replayed"] == 4
    replayed = (await receiver.wait_for(9, path="/replayed"))[5:]
    assert sorted(r.headers["webhook-id"] for r in replayed) == sorted(
        r.headers["webhook-id"] for r in first_pass
    )
    assert {r.body for r in replayed} == {r.body for r in first_pass}, "byte for byte the same events"


async def test_retries_of_a_deleted_endpoint_become_dead_letters(system: System, receiver: Receiver) -> None:
    acme = tenant()
    receiver.responder = lambda _: Reply(status=500)
    endpoint = system.add_endpoint(acme, receiver.url("/deleted-while-waiting"), ["#"], retry_schedule_s=[3])
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_waiting_1"), f"{acme}.a.b")
    await receiver.wait_for(1, path="/deleted-while-waiting")
    # force: until the dispatcher's next heartbeat (up to 5 s) the attempt may still count as in flight,
    # and without it the answer is 409 events_pending (test_endpoints has that case).
    with system.api() as api:
        assert api.delete(f"/v1/endpoints/{endpoint['id']}", params={"force": "true"}).status_code == 204
    [item] = await wait_dead(system, 1, endpoint_id=endpoint["id"])
    assert (item["reason"], item["event_id"], item["tenant"]) == ("endpoint_gone", "evt_waiting_1", acme)
    assert len(receiver.requests) == 1


def _state(system: System, event_id: str) -> list[str]:
    """The event's state at each endpoint, as the delivery log tells it ([] until it knows the event)."""
    with system.api() as api:
        answer = api.get(f"/v1/events/{event_id}")
    return [e["state"] for e in answer.json()["endpoints"]] if answer.status_code == 200 else []


def _is_path(path: str) -> Any:
    return lambda request: isinstance(request, Received) and request.path == path


async def test_the_cli_lists_and_redrives_dead_letters(system: System, receiver: Receiver) -> None:
    from support.system import cli as hookline

    acme = tenant()
    refusing = True
    receiver.responder = lambda _: Reply(status=404 if refusing else 204)
    endpoint = system.add_endpoint(acme, receiver.url("/cli-dead"), ["#"])
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_cli_dead"), f"{acme}.a.b")
    await wait_dead(system, 1, endpoint_id=endpoint["id"])
    listed = hookline(system, "dead-letters", "list", "--endpoint-id", endpoint["id"])["data"]
    assert [(item["event_id"], item["reason"], item["last_status"]) for item in listed] == [
        ("evt_cli_dead", "permanent_status", 404)
    ]
    refusing = False
    assert hookline(system, "dead-letters", "redrive", "--id", listed[0]["id"]) == {
        "redriven": 1,
        "skipped": 0,
    }
    await receiver.wait_for(2, path="/cli-dead")
    replayed = hookline(system, "replay", endpoint["id"], "--since", datetime.now(UTC).isoformat())
    assert replayed["replayed"] == 0
    json.dumps(replayed)


WEBHOOK_ID = "webhook-id"


# Every first attempt fails on purpose: a breaker opening would hold the retries back.
@pytest.mark.system_env({"HOOKLINE_BREAKER_FAILURE_THRESHOLD": "1000"})
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
    await eventually(lambda: asyncio.to_thread(_attempt_failed_with, system, "evt_hang_1", "timeout"))


async def test_an_endpoint_that_drops_the_connection_is_retried(system: System, receiver: Receiver) -> None:
    acme = tenant()
    replies = [Reply(close=True), Reply(close=True), Reply(status=200)]
    receiver.responder = lambda _: replies.pop(0) if replies else Reply(status=204)
    system.add_endpoint(acme, receiver.url("/drops"), ["#"])
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_drop_1"), f"{acme}.a.b")
    attempts = await receiver.wait_for(3, path="/drops", timeout_s=30)
    assert {a.headers["webhook-id"] for a in attempts} == {"evt_drop_1"}
    await eventually(lambda: asyncio.to_thread(_attempt_failed_with, system, "evt_drop_1", "network"))


def _attempt_failed_with(system: System, event_id: str, error: str) -> bool:
    every = [*system.dispatchers, *system.extra]
    return bool(logged(every, "delivery_attempt", event_id=event_id, outcome="retry", error=error))


@asynccontextmanager
async def proxied_dispatcher(
    system: System, **settings: str
) -> AsyncIterator[tuple[TcpProxy, services.Service]]:
    """The system's dispatchers stopped, and one started behind a proxy."""
    for dispatcher in system.dispatchers:
        assert dispatcher.stop() == 0
    upstream = urlsplit(system.amqp_url)
    async with TcpProxy(upstream.hostname or "127.0.0.1", upstream.port or 5672) as proxy:
        env = {**system.env, "HOOKLINE_AMQP_URL": proxy.url_for(system.amqp_url), **settings}
        dispatcher = services.start("dispatcher", env, system.log_dir, name="dispatcher-behind-proxy")
        system.extra.append(dispatcher)
        await asyncio.to_thread(dispatcher.wait_ready)
        yield proxy, dispatcher
        # Stopped from a thread: the proxy runs on this event loop, and the dispatcher's shutdown needs
        # the broker's answers (a cancel-ok) to pass through it.
        assert await asyncio.to_thread(dispatcher.stop) == 0


async def test_a_consumer_the_broker_dropped_without_a_word_is_attached_again(
    own_system: System, receiver: Receiver, rabbitmq: Broker
) -> None:
    """The broker's cancel (the queue was deleted by hand) never reaches the dispatcher, which believes
    it still consumes the queue: its check with the broker finds the queue gone or without a consumer,
    says so, and attaches again; events published afterwards are delivered."""
    system = own_system
    async with proxied_dispatcher(system, HOOKLINE_CONSUMER_CHECK_S="1") as (proxy, dispatcher):
        acme = tenant()
        # A cap needs a single consumer: the endpoint has a queue of its own, which the dispatcher consumes.
        # In a thread: the ingest answers once the dispatcher says (through the proxy, on this loop) it
        # knows the endpoint.
        endpoint = await asyncio.to_thread(
            system.add_endpoint, acme, receiver.url("/kept"), ["kept.*"], max_in_flight=10
        )
        await receiver.wait_for_ids(set(await publish(system, acme, "kept.x", ["evt_kept_before"])))
        [attached, *_] = logged([dispatcher], "consumer_attached", endpoint_id=endpoint["id"])

        proxy.drop_consumer_cancels(True)
        vhost = unquote(urlsplit(system.amqp_url).path.lstrip("/"))
        await rabbitmq.ctl_async(["delete_queue", "-p", vhost, f"hookline.endpoint.{endpoint['id']}"])

        async def cancel_dropped() -> bool:
            return proxy.cancels_dropped > 0

        await eventually(cancel_dropped)
        assert not logged([dispatcher], "consumer_cancelled_by_broker"), "the cancel was to be lost"

        async def found() -> bool:
            return bool(logged([dispatcher], "consumer_missing_at_broker", tag=attached["tag"], alert=True))

        await eventually(found, timeout_s=30)

        async def attached_again() -> bool:
            tags = {r["tag"] for r in logged([dispatcher], "consumer_attached", endpoint_id=endpoint["id"])}
            return len(tags) == 2  # the first consumer's, and a new one's

        await eventually(attached_again)
        await receiver.wait_for_ids(set(await publish(system, acme, "kept.x", ["evt_kept_after"])))


async def test_a_delivery_whose_ack_was_lost_is_not_sent_again(
    own_system: System, receiver: Receiver
) -> None:
    """The endpoint answers 2xx, then the dispatcher's ack is lost with its connection (the proxy holds
    it, then resets the connection): the broker hands the message out again, and the dispatcher, which
    recorded the delivery, acks it without a second POST. The receiver sees the event once."""
    system = own_system
    async with proxied_dispatcher(system) as (proxy, dispatcher):
        acme = tenant()

        def answer(request: Received) -> Reply:
            if request.headers[WEBHOOK_ID] == "evt_ack_lost":
                proxy.stall()  # before the 2xx: the ack that follows it cannot get through
            return Reply()

        receiver.responder = answer
        await asyncio.to_thread(system.add_endpoint, acme, receiver.url("/once"), ["once.*"])
        await publish(system, acme, "once.x", ["evt_ack_lost"])

        async def settled() -> bool:
            return bool(logged([dispatcher], "delivery_attempt", event_id="evt_ack_lost", outcome="success"))

        await eventually(settled)
        await proxy.cut()
        proxy.resume()

        async def acked_on_redelivery() -> bool:
            return bool(
                logged(
                    [dispatcher], "redelivery_already_settled", event_id="evt_ack_lost", outcome="delivered"
                )
            )

        await eventually(acked_on_redelivery, timeout_s=60)
        await receiver.wait_for_ids(set(await publish(system, acme, "once.x", ["evt_sentinel"])))
        assert Counter(r.headers[WEBHOOK_ID] for r in receiver.requests) == {
            "evt_ack_lost": 1,
            "evt_sentinel": 1,
        }
