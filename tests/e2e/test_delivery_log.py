""" "Where is my event?" answered by the ingest's delivery log, with the real services.

One event goes to five endpoints of its tenant: one that takes it, one that fails twice before taking
it, one paused, one that refuses it for good (400) and one that never verified. Its story shows each
endpoint's attempts (kind, status, timings, the start of the receiver's answer) and, while it waits, why.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections import Counter
from typing import Any

import httpx
import pytest
from support import services
from support.amqp import read_stream
from support.monitoring import set_status
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

OTHER_TOKEN = "other-tenant-token-0123456789"
SYSTEM_ENV = {
    "HOOKLINE_SECRET_KEY": "a-long-random-secret-key-for-the-tests-0123456789",
    "HOOKLINE_TENANT_TOKENS": f"other:{OTHER_TOKEN}",
    "HOOKLINE_RETRY_SCHEDULE_S": "2",
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "50",
}


class Receivers:
    def __init__(self, receiver: Receiver) -> None:
        self.seen: Counter[tuple[str, str]] = Counter()  # (path, webhook-id)
        receiver.responder = self._respond

    def _respond(self, request: Received) -> Reply:
        if json.loads(request.body).get("type") == "hookline.endpoint.verification":
            return Reply(status=503 if request.path == "/unverified" else 204)
        key = (request.path, request.headers["webhook-id"])
        self.seen[key] += 1
        if request.path == "/flaky" and self.seen[key] <= 2:
            return Reply(
                status=503, headers={"content-type": "text/plain", "x-request-id": "r-1"}, body=b"busy, later"
            )
        if request.path == "/refuses":
            return Reply(
                status=400, headers={"content-type": "application/json"}, body=b'{"error":"unknown type"}'
            )
        return Reply(status=200, headers={"content-type": "text/plain"}, body=b"thanks")


class Ingest:
    def __init__(self, system: System) -> None:
        self.base_url = system.ingest.base_url

    async def __call__(
        self, method: str, path: str, *, token: str = services.TOKEN, **kwargs: Any
    ) -> httpx.Response:
        async with httpx.AsyncClient(
            base_url=self.base_url, headers={"authorization": f"Bearer {token}"}, timeout=30
        ) as client:
            return await client.request(method, path, **kwargs)

    async def story(self, event_id: str) -> dict[str, Any] | None:
        response = await self("GET", f"/v1/events/{event_id}")
        return response.json() if response.status_code == 200 else None


def course(found: dict[str, Any], endpoint_id: str) -> dict[str, Any]:
    [mine] = [c for c in found["endpoints"] if c["endpoint_id"] == endpoint_id]
    return mine


async def test_an_events_story_at_every_endpoint(system: System, receiver: Receiver) -> None:
    api = Ingest(system)
    receivers = Receivers(receiver)
    acme = tenant()
    ok = system.add_endpoint(acme, receiver.url("/ok"), ["order.*"])
    flaky = system.add_endpoint(acme, receiver.url("/flaky"), ["order.*"])
    paused = system.add_endpoint(acme, receiver.url("/paused"), ["order.*"])
    refuses = system.add_endpoint(acme, receiver.url("/refuses"), ["order.*"])
    unverified = await asyncio.to_thread(
        system.add_endpoint, acme, receiver.url("/unverified"), ["order.*"], verify=True
    )
    system.add_endpoint(acme, receiver.url("/elsewhere"), ["invoice.*"])  # not subscribed
    await set_status(system, paused["id"], "pause")

    published = await api(
        "POST",
        "/v1/events",
        json={"tenant": acme, "type": "order.created", "subject": "o_1", "data": {"n": 1}},
    )
    assert published.status_code == 202, published.text
    event_id = published.json()["id"]

    # While the flaky endpoint waits for its retry, its story says so, and when.
    async def retrying() -> dict[str, Any] | None:
        found = await api.story(event_id)
        return found if found and course(found, flaky["id"])["state"] == "retrying" else None

    waiting = course(await eventually(retrying), flaky["id"])
    assert "in a delay queue until" in waiting["waiting_reason"] or "due" in waiting["waiting_reason"]
    assert waiting["next_attempt_at"] is not None
    first = waiting["attempts"][0]
    assert (first["kind"], first["status"], first["outcome"]) == ("delivery", 503, "retry")
    assert first["response_body"] == "busy, later"
    assert first["response_headers"]["x-request-id"] == "r-1"
    assert first["duration_ms"] > 0

    async def settled() -> dict[str, Any] | None:
        found = await api.story(event_id)
        wanted = {ok["id"]: "delivered", flaky["id"]: "delivered", refuses["id"]: "dead"}
        return found if found and all(course(found, e)["state"] == s for e, s in wanted.items()) else None

    found = await eventually(settled, timeout_s=30)
    assert (found["tenant"], found["type"], found["subject"]) == (acme, "order.created", "o_1")
    assert {c["endpoint_id"] for c in found["endpoints"]} == {
        ok["id"],
        flaky["id"],
        paused["id"],
        refuses["id"],
        unverified["id"],
    }
    delivered = course(found, ok["id"])
    assert [(a["kind"], a["status"]) for a in delivered["attempts"]] == [("delivery", 200)]
    assert delivered["attempts"][0]["response_body"] == "thanks"
    assert delivered["waiting_reason"] is None
    assert [(a["kind"], a["status"]) for a in course(found, flaky["id"])["attempts"]] == [
        ("delivery", 503), ("retry", 503), ("retry", 200),
    ]  # fmt: skip
    dead = course(found, refuses["id"])
    assert "dead-lettered (permanent_status)" in dead["waiting_reason"]
    assert dead["attempts"][0]["response_body"] == '{"error":"unknown type"}'
    assert course(found, paused["id"]) | {"attempts": []} == {
        "endpoint_id": paused["id"], "state": "paused", "attempts": [], "next_attempt_at": None,
        "waiting_reason": "the endpoint is paused; resume it to deliver",
    }  # fmt: skip
    assert course(found, unverified["id"])["state"] == "unverified"

    # Sent again by hand: one attempt now, same webhook-id, beside the event's course.
    resent = await api("POST", f"/v1/events/{event_id}/resend", json={"endpoint_id": ok["id"]})
    assert resent.status_code == 202, resent.text
    assert (resent.json()["kind"], resent.json()["status"], resent.json()["attempt"]) == ("manual", 200, 2)
    assert receivers.seen[("/ok", event_id)] == 2

    async def two_at_ok() -> list[dict[str, Any]] | None:
        found = await api.story(event_id)
        attempts = course(found, ok["id"])["attempts"] if found else []
        return attempts if len(attempts) == 2 else None

    assert [a["kind"] for a in await eventually(two_at_ok)] == ["delivery", "manual"]

    # An endpoint's attempts, newest first, a page at a time.
    page = (await api("GET", f"/v1/endpoints/{flaky['id']}/attempts", params={"limit": 2})).json()
    assert [a["status"] for a in page["data"]] == [200, 503]
    rest = (
        await api("GET", f"/v1/endpoints/{flaky['id']}/attempts", params={"after": page["next_after"]})
    ).json()
    assert ([a["status"] for a in rest["data"]], rest["next_after"]) == ([503], None)
    failures = (await api("GET", f"/v1/endpoints/{flaky['id']}/attempts", params={"outcome": "retry"})).json()
    assert len(failures["data"]) == 2

    # Recent events with a state filter; another tenant's token sees none of it.
    listed = (await api("GET", "/v1/events", params={"tenant": acme, "state": "paused"})).json()
    assert [e["id"] for e in listed["data"]] == [event_id]
    assert (await api("GET", "/v1/events", params={"tenant": acme, "state": "retrying"})).json()["data"] == []
    assert (await api("GET", f"/v1/events/{event_id}", token=OTHER_TOKEN)).status_code == 404
    assert (await api("GET", "/v1/events", token=OTHER_TOKEN)).json()["data"] == []
    refused = await api(
        "POST", f"/v1/events/{event_id}/resend", token=OTHER_TOKEN, json={"endpoint_id": ok["id"]}
    )
    assert refused.status_code == 404

    # The receivers' answers are sealed at rest: the telemetry stream does not hold them in clear.
    raw = b"".join(m.body for m in await read_stream(system.amqp_url, "hookline.telemetry.log", at_least=1))
    assert b"thanks" not in raw
    assert b"busy, later" not in raw
    assert b"enc:v2:" in raw

    # The same story from the command line.
    env = {**system.env, "HOOKLINE_INGEST_URL": system.ingest.base_url}
    shown = await asyncio.to_thread(
        subprocess.run,
        [services.HOOKLINE, "events", "show", event_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert course(json.loads(shown.stdout), flaky["id"])["state"] == "delivered"


async def test_an_event_held_back_by_ordering_says_behind_which(system: System, receiver: Receiver) -> None:
    api = Ingest(system)
    acme = tenant()
    failing: set[str] = set()
    delivered: list[str] = []

    def respond(request: Received) -> Reply:
        event_id = request.headers["webhook-id"]
        if event_id in failing:
            return Reply(status=503)
        delivered.append(event_id)
        return Reply(status=204)

    receiver.responder = respond
    endpoint = system.add_endpoint(acme, receiver.url("/ordered"), ["#"], ordered=True)

    async def publish(event_id: str) -> None:
        body = {"id": event_id, "tenant": acme, "type": "order.updated", "subject": "o_7", "data": {}}
        assert (await api("POST", "/v1/events", json=body)).status_code == 202

    first, second = f"evt_first_{acme}", f"evt_second_{acme}"
    failing.add(first)
    await publish(first)
    await receiver.wait_for(1, path="/ordered")
    await publish(second)

    async def held_back() -> dict[str, Any] | None:
        found = await api.story(second)
        mine = course(found, endpoint["id"]) if found else None
        return mine if mine and "held back by ordering" in (mine["waiting_reason"] or "") else None

    waiting = await eventually(held_back, timeout_s=20)
    assert waiting["state"] == "pending"
    assert f"behind event {first}" in waiting["waiting_reason"]
    assert waiting["attempts"] == []  # put back without spending an attempt
    failing.clear()
    await eventually(lambda: _true(delivered == [first, second]), timeout_s=30)


async def _true(value: Any) -> bool:
    return bool(value)
