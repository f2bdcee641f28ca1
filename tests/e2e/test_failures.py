"""Failed attempts lose nothing: retried failures are delivered later, permanent ones are dead letters."""

from __future__ import annotations

import pytest
from conftest import System, tenant
from support.amqp import publish_event, read_stream
from support.receiver import Received, Receiver, Reply
from test_delivery_path import event

pytestmark = pytest.mark.e2e


async def test_a_failing_endpoint_gets_the_event_again_until_it_succeeds(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    answers = iter([Reply(status=500), Reply(status=503), Reply(status=204)])
    receiver.responder = lambda _: next(answers, Reply(status=204))
    system.add_endpoint(acme, receiver.url("/flaky"), ["#"])
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_flaky_1"), f"{acme}.a.b")
    attempts = await receiver.wait_for(3, path="/flaky")
    assert [r.headers["webhook-id"] for r in attempts] == ["evt_flaky_1"] * 3
    assert len({r.body for r in attempts}) == 1, "the body is identical on every attempt"


async def test_a_permanent_failure_is_dead_lettered_at_once(system: System, receiver: Receiver) -> None:
    acme = tenant()

    def refuse(_: Received) -> Reply:
        return Reply(status=400)

    receiver.responder = refuse
    endpoint = system.add_endpoint(acme, receiver.url("/refuses"), ["#"])
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_refused_1"), f"{acme}.a.b")
    dead = await read_stream(system.amqp_url, "hookline.dead-letters", at_least=1)
    mine = [m for m in dead if (m.headers or {}).get("x-hookline-endpoint-id") == endpoint["id"]]
    assert len(mine) == 1
    headers = mine[0].headers or {}
    assert (
        headers["x-hookline-reason"],
        headers["x-hookline-last-status"],
        headers["x-hookline-attempts"],
    ) == (
        "permanent_status",
        400,
        1,
    )
    assert headers["x-hookline-event-id"] == "evt_refused_1"
    assert len(receiver.requests) == 1
