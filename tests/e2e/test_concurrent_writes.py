"""Concurrent changes to one endpoint are never silently reverted.

Every writer of an endpoint (the API, the ingest recording a verification, a dispatcher disabling after
a 410, the health monitor disabling after a breaker stayed open) used to write a whole copy of the
endpoint as it had read it earlier; the change log applied the later write, so whatever another writer
had changed in between (a rotated secret, an edit) was lost without anyone being told. Each test here
makes two writers race for real and checks that both changes are in the end state, or that the loser
was told (409). Conditional API writes among themselves (If-Match) are
tests/integration/test_conditional_writes.py.

Times are shrunk through settings: 3 consecutive failures open a breaker, the first cooldown is 1 s,
and an endpoint whose breaker stays open 4 s is disabled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
from support import services
from support.amqp import event, publish_event
from support.proxy import TcpProxy
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

SYSTEM_ENV = {
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "3",
    "HOOKLINE_BREAKER_COOLDOWN_S": "1",
    "HOOKLINE_DISABLE_AFTER_S": "4",
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
}


def is_verification(request: Received) -> bool:
    return bool(json.loads(request.body).get("type") == "hookline.endpoint.verification")


def get_endpoint(system: System, endpoint_id: str) -> dict[str, Any]:
    with system.api() as api:
        response = api.get(f"/v1/endpoints/{endpoint_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def current_secret(system: System, endpoint_id: str) -> str:
    with system.api() as api:
        response = api.get(f"/v1/endpoints/{endpoint_id}/secret")
    assert response.status_code == 200, response.text
    return str(response.json()["secret"])


def rotate(system: System, endpoint_id: str) -> str:
    """A rotation without overlap: from now on only the new secret signs."""
    with system.api() as api:
        response = api.post(f"/v1/endpoints/{endpoint_id}/rotate-secret", json={"overlap_s": 0})
    assert response.status_code == 200, response.text
    return str(response.json()["secret"])


@dataclass
class Edits:
    last_applied: str = ""  # the description of the edit the API accepted last (the highest version)
    last_version: int = 0
    applied: int = 0
    refused: int = 0  # 409 endpoint_changed: the edit lost a race and its caller was told
    after_disabled: int = 0


def edit_until_disabled(
    system: System,
    endpoint_id: str,
    label: str,
    *,
    writers: int = 4,
    timeout_s: float = 30,
    after_three_edits: Callable[[], None] = lambda: None,
) -> Edits:
    """Edit the description from several clients at once, as fast as the API answers, until three
    accepted edits show the endpoint disabled: edits run before, across and after the moment another
    writer disables it (``after_three_edits`` may let that writer go). Concurrent edits are conditional
    too: each is accepted or answered 409."""
    edits = Edits()
    lock = threading.Lock()
    deadline = time.monotonic() + timeout_s

    def edit(writer: int) -> None:
        with system.api() as api:
            for n in itertools.count():
                with lock:
                    if edits.after_disabled >= 3 or time.monotonic() > deadline:
                        return
                description = f"{label} edit {writer}.{n}"
                response = api.patch(f"/v1/endpoints/{endpoint_id}", json={"description": description})
                with lock:
                    if response.status_code == 409:
                        assert response.json()["error"] == "endpoint_changed", response.text
                        edits.refused += 1
                        continue
                    assert response.status_code == 200, response.text
                    written = response.json()
                    assert written["description"] == description
                    edits.applied += 1
                    if edits.applied == 3:
                        after_three_edits()
                    if written["version"] > edits.last_version:
                        edits.last_version, edits.last_applied = written["version"], description
                    if written["status"] == "disabled":
                        edits.after_disabled += 1

    with concurrent.futures.ThreadPoolExecutor(writers) as pool:
        for done in [pool.submit(edit, writer) for writer in range(writers)]:
            done.result()
    assert edits.after_disabled >= 3, f"not disabled within {timeout_s} s ({edits})"
    return edits


async def test_a_rotation_during_a_verification_handshake_survives_it(
    system: System, receiver: Receiver
) -> None:
    """The handshake's result is recorded on the endpoint as it is when the receiver answers: a secret
    rotated while the receiver was still answering stays the current secret, and the endpoint is
    verified."""
    acme = tenant()
    verification_answer = Reply(status=503)

    def respond(request: Received) -> Reply:
        return verification_answer if is_verification(request) else Reply(status=204)

    receiver.responder = respond
    created = await asyncio.to_thread(
        system.add_endpoint, acme, receiver.url("/handshake"), ["#"], verify=True
    )
    assert created["verified"] is False, "the first handshake got a 503"
    endpoint_id, first_secret = created["id"], created["secret"]

    # The receiver is fixed, but answers the next handshake only once the rotation is done.
    rotation_done = asyncio.Event()
    verification_answer = Reply(status=204, until=rotation_done)

    def verify() -> httpx.Response:
        with system.api() as api:
            return api.post(f"/v1/endpoints/{endpoint_id}/verify")

    handshake = asyncio.ensure_future(asyncio.to_thread(verify))
    await receiver.wait_for(2, path="/handshake")
    rotated = await asyncio.to_thread(rotate, system, endpoint_id)
    assert receiver.in_flight == 1, "the rotation was answered while the handshake was still in flight"
    assert not handshake.done()
    rotation_done.set()

    answer = await handshake
    assert answer.status_code == 200, answer.text
    assert (answer.json()["verified"], answer.json()["verification"]["status"]) == (True, 204)
    stored = await asyncio.to_thread(get_endpoint, system, endpoint_id)
    assert (stored["verified"], stored["verification"]["ok"]) == (True, True)
    assert stored["version"] == created["version"] + 2, "the rotation and the verification, both applied"
    assert await asyncio.to_thread(current_secret, system, endpoint_id) == rotated != first_secret

    # Deliveries are signed with the rotated secret only (no overlap was asked for).
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_after_handshake"), f"{acme}.a.b")
    delivered = (await receiver.wait_for(3, path="/handshake"))[2]
    assert delivered.headers["webhook-id"] == "evt_after_handshake"
    Webhook(rotated).verify(delivered.body, delivered.headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(first_secret).verify(delivered.body, delivered.headers)


async def test_a_410_disable_keeps_a_rotation_and_edits_made_during_the_attempt(
    system: System, receiver: Receiver
) -> None:
    """A dispatcher disables an endpoint that answered 410 on the endpoint as it is by then: a secret
    rotated and edits made while the receiver was answering survive, and the endpoint is disabled."""
    acme = tenant()
    gone = True
    # The 410 comes back once the test has rotated the secret and edited the endpoint.
    written = asyncio.Event()
    receiver.responder = lambda _: Reply(status=410, until=written) if gone else Reply(status=204)
    endpoint = system.add_endpoint(acme, receiver.url("/gone-later"), ["#"])
    endpoint_id, first_secret = endpoint["id"], endpoint["secret"]
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_race_410"), f"{acme}.a.b")
    await receiver.wait_for(1, path="/gone-later")

    rotated = await asyncio.to_thread(rotate, system, endpoint_id)
    with system.api() as api:
        edit = await asyncio.to_thread(
            api.patch, f"/v1/endpoints/{endpoint_id}", json={"description": "edited during the attempt"}
        )
    assert edit.status_code == 200, edit.text
    assert receiver.in_flight == 1, "rotated and edited while the attempt was still waiting for its 410"
    # Then edits from several clients, as fast as the API answers, across the moment the dispatcher
    # disables the endpoint (its 410 let go after three of them): each is either kept or refused with a
    # 409, never accepted then reverted.
    loop = asyncio.get_running_loop()
    edits = await asyncio.to_thread(
        edit_until_disabled, system, endpoint_id, "410",
        after_three_edits=lambda: loop.call_soon_threadsafe(written.set),
    )  # fmt: skip

    stored = await asyncio.to_thread(get_endpoint, system, endpoint_id)
    assert stored["status"] == "disabled"
    assert stored["description"] == edits.last_applied, f"an accepted edit was reverted ({edits})"
    assert await asyncio.to_thread(current_secret, system, endpoint_id) == rotated
    assert "endpoint_disabled" in system.logs()

    # Resumed, the endpoint gets deliveries signed with the rotated secret.
    gone = False
    with system.api() as api:
        assert api.post(f"/v1/endpoints/{endpoint_id}/resume").json()["status"] == "active"
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_after_410"), f"{acme}.a.b")
    delivered = (await receiver.wait_for(2, path="/gone-later"))[1]
    assert delivered.headers["webhook-id"] == "evt_after_410"
    Webhook(rotated).verify(delivered.body, delivered.headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(first_secret).verify(delivered.body, delivered.headers)


def breaker_state(system: System, endpoint_id: str) -> str:
    with system.monitor_api() as api:
        response = api.get(f"/v1/endpoints/{endpoint_id}/health")
    assert response.status_code == 200, response.text
    return str(response.json()["breaker_state"])


def replace_monitor(system: System, env: dict[str, str], name: str, *, timeout_s: float = 60) -> None:
    """Stop the monitor (cleanly), start another with ``env``, and wait until it leads."""
    assert system.monitor.stop() == 0
    system.monitor = services.start("health-monitor", env, system.log_dir, name=name)
    system.monitor.wait_ready(timeout_s=timeout_s)
    deadline = time.monotonic() + timeout_s
    with system.monitor_api() as api:
        while not api.get("/v1/status").json()["leader"]:
            assert time.monotonic() < deadline, f"{name} does not lead"
            time.sleep(0.1)


def monitor_logged(system: System, event_name: str, endpoint_id: str, **fields: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in system.monitor.log().splitlines() if line.startswith("{")]
    return [
        line
        for line in lines
        if line.get("event") == event_name
        and line.get("endpoint_id") == endpoint_id
        and all(line.get(key) == value for key, value in fields.items())
    ]


async def test_the_monitor_disabling_an_endpoint_keeps_edits_made_meanwhile(
    system: System, receiver: Receiver
) -> None:
    """The health monitor disables an endpoint whose breaker stayed open too long on the endpoint as it
    is by then: a rotation and an edit made while it decides survive, and the endpoint ends disabled.

    The monitor reaches the broker through a proxy that the test stalls before the disable is due: the
    rotation and the edit are written meanwhile (the ingest is not behind the proxy), so the monitor
    cannot have seen them when it starts disabling (its breaker shows closed). A writer that used the
    definition it had (a stale copy) would revert both once the network is back; the monitor first
    catches up with the change log, then writes conditionally."""
    upstream = urlsplit(system.amqp_url)
    async with TcpProxy(upstream.hostname or "127.0.0.1", upstream.port or 5672) as proxy:
        # A long heartbeat: the stall below (at most ~12 s) is a delay, not a lost connection.
        url = proxy.url_for(system.amqp_url)
        proxied = {**system.env, "HOOKLINE_AMQP_URL": url + ("&" if "?" in url else "?") + "heartbeat=60"}
        await asyncio.to_thread(replace_monitor, system, proxied, "health-monitor-proxied")
        try:
            acme = tenant()
            receiver.responder = lambda _: Reply(status=500)
            endpoint = await asyncio.to_thread(system.add_endpoint, acme, receiver.url("/failing"), ["#"])
            endpoint_id = endpoint["id"]
            for n in range(4):
                await publish_event(system.amqp_url, event(acme, "a.b", f"evt_failing_{n}"), f"{acme}.a.b")

            async def breaker_is(state: str) -> bool:
                return await asyncio.to_thread(breaker_state, system, endpoint_id) == state

            await eventually(lambda: breaker_is("open"), timeout_s=30, every_s=0.1)

            # Once its open-breaker alert is out (published by the same loop that disables), the monitor
            # has nothing to publish before the disable is due, 4 s after the breaker opened.
            async def alerted() -> bool:
                return bool(
                    monitor_logged(system, "alert", endpoint_id, alert="breaker_open", state="firing")
                )

            await eventually(alerted, timeout_s=10, every_s=0.1)
            proxy.stall()
            rotated = await asyncio.to_thread(rotate, system, endpoint_id)
            with system.api() as api:
                edit = await asyncio.to_thread(
                    api.patch, f"/v1/endpoints/{endpoint_id}", json={"description": "edited meanwhile"}
                )
            assert edit.status_code == 200, edit.text
            assert not monitor_logged(system, "endpoint_disabling", endpoint_id), (
                "edited before the monitor started disabling"
            )

            # The monitor starts disabling the endpoint (within 4 s; 10 s more if a periodic snapshot it
            # publishes in the same loop has to time out first); its write waits for the network.
            async def disabling() -> bool:
                return bool(monitor_logged(system, "endpoint_disabling", endpoint_id))

            await eventually(disabling, timeout_s=20, every_s=0.1)
            stored = await asyncio.to_thread(get_endpoint, system, endpoint_id)
            assert stored["status"] == "active", "not disabled yet: the monitor cannot reach the broker"
            proxy.resume()

            async def disabled() -> dict[str, Any] | None:
                current = await asyncio.to_thread(get_endpoint, system, endpoint_id)
                return current if current["status"] == "disabled" else None

            stored = await eventually(disabled, timeout_s=30)
            assert stored["description"] == "edited meanwhile", "the edit was reverted"
            assert await asyncio.to_thread(current_secret, system, endpoint_id) == rotated
            assert stored["version"] == edit.json()["version"] + 1, "the disable came after the edit"
            await eventually(lambda: breaker_is("closed"))  # forgotten once the endpoint is disabled
            [disabled_line] = monitor_logged(system, "endpoint_disabled", endpoint_id)
            assert disabled_line["reason"].startswith("circuit breaker open for more than 4 s")
        finally:
            proxy.resume()
            await asyncio.to_thread(replace_monitor, system, system.env, "health-monitor-again")
