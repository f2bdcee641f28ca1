"""Operator alert sinks with the real services: an endpoint's breaker opens and closes; the ops sink
(routed to breaker alerts, signed) and the Slack sink (every alert) each get "firing" then "resolved"."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from support.monitoring import publish, wait_leader
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

from hookline.shared.outbound import signing

pytestmark = pytest.mark.e2e

SECRET = "whsec_" + "c2luay1zZWNyZXQtZm9yLXRoZS10ZXN0cy0wMTIz"
SYSTEM_ENV = {
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "3",
    "HOOKLINE_BREAKER_COOLDOWN_S": "2",
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    "HOOKLINE_ALERT_WEBHOOK_SECRET": SECRET,
}


async def test_alerts_reach_the_operators_sinks_routed_signed_and_in_slack_form(
    system: System, receiver: Receiver
) -> None:
    failing = True
    sunk: dict[str, list[Received]] = {"/ops": [], "/slack": []}

    def respond(request: Received) -> Reply:
        if request.path in sunk:
            sunk[request.path].append(request)
            return Reply(status=200)
        return Reply(status=500 if failing else 204)

    receiver.responder = respond
    system.env["HOOKLINE_ALERT_WEBHOOK_URLS"] = (
        f"breaker_*={receiver.url('/ops')}, slack+{receiver.url('/slack')}"
    )
    await asyncio.to_thread(system.restart_monitor)
    await wait_leader(system.monitor)

    acme = tenant()
    endpoint = system.add_endpoint(acme, receiver.url("/broken"), ["#"])
    await publish(system, acme, "a.b", [f"evt_sink_{n}" for n in range(4)])

    def states(path: str) -> list[tuple[str, str]]:
        bodies = [json.loads(r.body) for r in sunk[path]]
        if path == "/slack":
            return [("text", body["text"]) for body in bodies]
        return [(body["alert"], body["state"]) for body in bodies if body["endpoint_id"] == endpoint["id"]]

    await eventually(lambda: _true(("breaker_open", "firing") in states("/ops")), timeout_s=30)
    failing = False
    await eventually(lambda: _true(("breaker_open", "resolved") in states("/ops")), timeout_s=30)
    assert states("/ops") == [("breaker_open", "firing"), ("breaker_open", "resolved")]

    # Signed like every hookline delivery, with the alert's id as webhook-id.
    for request in sunk["/ops"]:
        headers = request.headers
        assert signing.verify(
            SECRET,
            headers["webhook-id"],
            int(headers["webhook-timestamp"]),
            request.body,
            headers["webhook-signature"],
        )

    # Slack gets text, for every alert (not only breaker ones), the endpoint named in it. Each sink is
    # posted to on its own: Slack's "resolved" may come a moment after the other sink's.
    def texts() -> list[str]:
        return [text for _, text in states("/slack") if endpoint["id"] in text]

    await eventually(
        lambda: _true(any(t.startswith(":large_green_circle: *breaker_open* resolved") for t in texts())),
        explain=lambda: str(texts()),
    )
    assert any(t.startswith(":red_circle: *breaker_open* firing") for t in texts()), texts()


async def _true(value: Any) -> bool:
    return bool(value)
