"""Endpoint lifecycle and security with the real services: verification, rotation, sealed secrets, a
dispatcher refusing a wrong key; and per-endpoint headers and auth as a customer whose receiver sits
behind an API gateway sees them (from test_endpoint_auth.py): its own headers and credentials on every
delivery (basic, bearer, an OAuth2 client-credentials token fetched once, refreshed on a 401 without
spending an attempt), never shown back by the API, sealed at rest. The whole module runs with
HOOKLINE_SECRET_KEY set (secrets sealed at rest). At the API alone (integration tests): tenant-scoped
tokens, tests/integration/test_tenant_tokens.py; reserved headers and bad auth refused,
tests/integration/test_endpoint_auth.py.

And (from test_delivery_log.py): "Where is my event?" answered by the ingest's delivery log, with the
real services.

One event goes to five endpoints of its tenant: one that takes it, one that fails twice before taking
it, one paused, one that refuses it for good (400) and one that never verified. Its story shows each
endpoint's attempts (kind, status, timings, the start of the receiver's answer) and, while it waits, why.

The module runs with both modules' settings: HOOKLINE_SECRET_KEY, both tenant tokens, retries every
2 s and breakers out of the way (50 failures), as test_delivery_log.py had them.

And (from test_ssrf.py, on a system of its own that refuses private targets): sSRF protection with the
real services: should a private target get registered anyway, it is refused at delivery time, as a
permanent failure with the reason. The refusals at registration are
tests/integration/test_ssrf_registration.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
from support import services
from support.amqp import event, publish_event, read_stream
from support.monitoring import set_status
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

TENANT_TOKEN = "acme-tenant-token-0123456789"
OTHER_TOKEN = "other-tenant-token-0123456789"
SYSTEM_ENV = {
    "HOOKLINE_SECRET_KEY": "a-long-random-secret-key-for-the-tests-0123456789",
    "HOOKLINE_TENANT_TOKENS": f"acme:{TENANT_TOKEN},other:{OTHER_TOKEN}",
    "HOOKLINE_RETRY_SCHEDULE_S": "2",
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "50",
}


def is_verification(request: Received) -> bool:
    return bool(json.loads(request.body).get("type") == "hookline.endpoint.verification")


async def test_an_endpoint_gets_deliveries_only_once_verified(system: System, receiver: Receiver) -> None:
    acme = tenant()
    healthy = False
    receiver.responder = lambda _: Reply(status=204 if healthy else 503)
    # In a thread: the handshake reaches the receiver, which runs on this test's event loop.
    endpoint = await asyncio.to_thread(
        system.add_endpoint, acme, receiver.url("/verify-me"), ["#"], verify=True
    )
    assert endpoint["verified"] is False
    assert (endpoint["verification"]["ok"], endpoint["verification"]["status"]) == (False, 503)
    [handshake] = receiver.requests
    assert is_verification(handshake)
    Webhook(endpoint["secret"]).verify(handshake.body, handshake.headers)  # signed like any delivery

    await publish_event(system.amqp_url, event(acme, "a.b", "evt_unverified_1"), f"{acme}.a.b")

    def state() -> list[str]:
        with system.api() as api:
            answer = api.get("/v1/events/evt_unverified_1")
        return [e["state"] for e in answer.json()["endpoints"]] if answer.status_code == 200 else []

    await eventually(lambda: asyncio.to_thread(lambda: state() == ["unverified"]))
    assert len(receiver.requests) == 1, "no delivery to an unverified endpoint; the event waits"

    healthy = True
    with system.api() as api:
        verified = (await asyncio.to_thread(api.post, f"/v1/endpoints/{endpoint['id']}/verify")).json()
    assert (verified["verified"], verified["verification"]["ok"]) == (True, True)
    delivered = await receiver.wait_for(3, path="/verify-me")
    assert delivered[2].headers["webhook-id"] == "evt_unverified_1"


async def test_rotation_signs_with_both_secrets_during_the_overlap(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    endpoint = system.add_endpoint(acme, receiver.url("/rotated"), ["#"])
    old_secret = endpoint["secret"]
    with system.api() as api:
        rotated = api.post(f"/v1/endpoints/{endpoint['id']}/rotate-secret", json={"overlap_s": 8}).json()
        assert api.get(f"/v1/endpoints/{endpoint['id']}/secret").json()["secret"] == rotated["secret"]
    new_secret = rotated["secret"]
    assert new_secret != old_secret
    expires_at = datetime.fromisoformat(rotated["previous_expires_at"])

    # Published at once, signed well within the 8 s overlap (a delivery takes milliseconds, a second or
    # two on a loaded machine): hookline stamps when it signed, and that is what the check is about.
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_overlap"), f"{acme}.a.b")
    [during] = await receiver.wait_for(1, path="/rotated")
    signed_s = int(during.headers["webhook-timestamp"])  # whole seconds, rounded down
    assert signed_s + 1 <= expires_at.timestamp(), "signed after the overlap: the machine took over 7 s"
    assert len(during.headers["webhook-signature"].split()) == 2
    Webhook(old_secret).verify(during.body, during.headers)
    Webhook(new_secret).verify(during.body, during.headers)

    # Once the overlap is over (hookline's expiry, by this machine's clock, which the dispatchers share),
    # an event published then is signed with the new secret alone.
    await asyncio.sleep(max(0.0, (expires_at - datetime.now(UTC)).total_seconds()) + 0.1)
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_after_overlap"), f"{acme}.a.b")
    after = (await receiver.wait_for(2, path="/rotated"))[1]
    assert len(after.headers["webhook-signature"].split()) == 1
    Webhook(new_secret).verify(after.body, after.headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(old_secret).verify(after.body, after.headers)


async def test_secrets_are_sealed_in_the_endpoint_log_and_never_logged(
    system: System, receiver: Receiver
) -> None:
    endpoint = system.add_endpoint(tenant(), receiver.url("/sealed"), ["#"])
    records = await read_stream(system.amqp_url, "hookline.endpoints", at_least=1)
    stored = b"".join(record.body for record in records)
    assert endpoint["secret"].encode() not in stored
    assert b"whsec_" not in stored
    assert b"enc:v2:" in stored
    assert endpoint["secret"] not in system.logs()
    with system.api() as api:
        listed = api.get("/v1/endpoints").json()["data"]
    assert all("secret" not in item and "secrets" not in item for item in listed)


def test_a_dispatcher_with_the_wrong_key_refuses_to_start(
    system: System, receiver: Receiver, tmp_path: Path
) -> None:
    system.add_endpoint(tenant(), receiver.url("/any"), ["#"])
    env = {**system.env, "HOOKLINE_SECRET_KEY": "not-the-key-that-sealed-these-secrets-0000"}
    wrong = services.start("dispatcher", env, tmp_path, name="dispatcher-wrong-key")
    assert wrong.process.wait(60) == 1
    assert "secret_key_unusable" in wrong.log()
    wrong.stop()


def client(system: System) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=30
    )


async def publish(system: System, acme: str, event_id: str) -> None:
    async with client(system) as api:
        answer = await api.post(
            "/v1/events", json={"id": event_id, "tenant": acme, "type": "order.created", "data": {}}
        )
    assert answer.status_code == 202, answer.text


def arrived(receiver: Receiver, path: str, event_id: str) -> list[Received]:
    return [
        r for r in receiver.requests if r.path == path and json.loads(r.body or b"{}").get("id") == event_id
    ]


async def test_headers_and_basic_auth_go_with_every_delivery_and_are_never_shown(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    endpoint = system.add_endpoint(
        acme, receiver.url("/basic"), ["order.*"],
        headers={"X-Gateway-Key": "gw-secret-1", "X-Team": "payments"},
        auth={"type": "basic", "username": "hook", "password": "pa55-word"},
    )  # fmt: skip
    assert endpoint["headers"] == ["X-Gateway-Key", "X-Team"]
    assert endpoint["auth"] == {
        "type": "basic", "username": "hook", "client_id": None, "token_url": None, "scope": None, "audience": None,
    }  # fmt: skip
    await publish(system, acme, f"evt_basic_{acme}")
    await eventually(lambda: asyncio.sleep(0, bool(arrived(receiver, "/basic", f"evt_basic_{acme}"))))
    [delivery] = arrived(receiver, "/basic", f"evt_basic_{acme}")
    assert delivery.headers["x-gateway-key"] == "gw-secret-1"
    assert delivery.headers["x-team"] == "payments"
    assert delivery.headers["authorization"] == "Basic " + base64.b64encode(b"hook:pa55-word").decode()
    assert delivery.headers["webhook-signature"].startswith("v1,")  # still signed

    # Never shown back, nor kept in the clear: the endpoint change log holds them sealed.
    async with client(system) as api:
        shown = [
            (await api.get(f"/v1/endpoints/{endpoint['id']}")).text,
            (await api.get(f"/v1/endpoints?tenant={acme}")).text,
        ]
    for text in shown:
        assert "gw-secret-1" not in text
        assert "pa55-word" not in text
    log = system.logs()
    assert "gw-secret-1" not in log
    assert "pa55-word" not in log

    # PATCH replaces them: a bearer token instead, and no headers.
    async with client(system) as api:
        changed = await api.patch(
            f"/v1/endpoints/{endpoint['id']}",
            json={"headers": None, "auth": {"type": "bearer", "token": "tok-abc"}},
        )
    assert changed.status_code == 200, changed.text
    assert changed.json()["headers"] == []
    assert changed.json()["auth"]["type"] == "bearer"
    await publish(system, acme, f"evt_bearer_{acme}")
    await eventually(lambda: asyncio.sleep(0, bool(arrived(receiver, "/basic", f"evt_bearer_{acme}"))))
    [bearer] = arrived(receiver, "/basic", f"evt_bearer_{acme}")
    assert bearer.headers["authorization"] == "Bearer tok-abc"
    assert "x-gateway-key" not in bearer.headers


async def test_an_oauth2_token_is_fetched_once_and_refreshed_on_a_401_within_the_attempt(
    system: System, receiver: Receiver
) -> None:
    """The receiver is its own authorization server: ``/token`` issues tok-1, tok-2, ...; ``/oauth``
    takes only tokens not revoked. Revoking tok-1 makes the next delivery get a 401, fetch tok-2 and
    be delivered, all as one attempt."""
    issued: list[dict[str, Any]] = []
    revoked: set[str] = set()
    token_fails = {"on": False}

    def respond(request: Received) -> Reply:
        if request.path == "/token":
            if token_fails["on"]:
                return Reply(status=500)
            issued.append(
                {
                    "form": parse_qs(request.body.decode()),
                    "authorization": request.headers.get("authorization"),
                }
            )
            token = f"tok-{len(issued)}"
            return Reply(status=200, headers={"content-type": "application/json"},
                         body=json.dumps({"access_token": token, "token_type": "Bearer", "expires_in": 3600}).encode())  # fmt: skip
        if request.path == "/oauth":
            token = request.headers.get("authorization", "").removeprefix("Bearer ")
            return Reply(status=204 if token.startswith("tok-") and token not in revoked else 401)
        return Reply()

    receiver.responder = respond
    acme = tenant()
    endpoint = system.add_endpoint(
        acme, receiver.url("/oauth"), ["order.*"],
        auth={
            "type": "oauth2_client_credentials", "token_url": receiver.url("/token"), "client_id": "hookline",
            "client_secret": "cs-123", "scope": "webhooks:write",
        },
        retry_schedule_s=[3, 3, 3, 3, 3],  # room to see the failed attempt before the retry that succeeds
    )  # fmt: skip
    assert endpoint["auth"]["client_id"] == "hookline"
    assert "cs-123" not in json.dumps(endpoint)

    def accepted(event_id: str) -> bool:
        return any(
            r.headers.get("authorization", "").removeprefix("Bearer ") not in revoked
            for r in arrived(receiver, "/oauth", event_id)
        )

    async def course(event_id: str) -> dict[str, Any] | None:
        async with client(system) as api:
            story = (await api.get(f"/v1/events/{event_id}")).json()
        mine = [c for c in story.get("endpoints", []) if c["endpoint_id"] == endpoint["id"]]
        return mine[0] if mine else None

    # Until both dispatchers have delivered (each then holds a token of its own).
    delivered_by: set[str] = set()
    for n in range(40):
        event_id = f"evt_oauth_{n}_{acme}"
        await publish(system, acme, event_id)
        await eventually(lambda: asyncio.sleep(0, accepted(event_id)))  # noqa: B023 - awaited here
        found = await eventually(lambda: course(event_id))  # noqa: B023
        delivered_by |= {a["dispatcher_id"] for a in found["attempts"]}
        if len(delivered_by) == len(system.dispatchers):
            break
    assert len(delivered_by) == len(system.dispatchers)
    # One token per dispatcher, never one per delivery.
    assert len(issued) == len(system.dispatchers)
    assert issued[0]["form"] == {"grant_type": ["client_credentials"], "scope": ["webhooks:write"]}
    assert issued[0]["authorization"] == "Basic " + base64.b64encode(b"hookline:cs-123").decode()

    revoked.update(f"tok-{n}" for n in range(1, len(issued) + 1))
    after_revocation = f"evt_oauth_after_{acme}"
    await publish(system, acme, after_revocation)
    await eventually(lambda: asyncio.sleep(0, accepted(after_revocation)))
    statuses = [
        401 if r.headers["authorization"].removeprefix("Bearer ") in revoked else 204
        for r in arrived(receiver, "/oauth", after_revocation)
    ]
    assert statuses == [401, 204]  # refused, a new token fetched, sent again

    # One attempt, delivered: the refresh spent none.
    async def delivered(event_id: str) -> list[dict[str, Any]] | None:
        found = await course(event_id)
        return found["attempts"] if found and found["state"] == "delivered" else None

    [attempt] = await eventually(lambda: delivered(after_revocation))
    assert attempt["status"] == 204

    # A token URL that fails: the attempt fails as "auth" and is retried like any failure.
    token_fails["on"] = True
    revoked.update(f"tok-{n}" for n in range(1, len(issued) + 1))
    failing = f"evt_oauth_failing_{acme}"
    await publish(system, acme, failing)

    async def failed_for_auth() -> bool:
        found = await course(failing)
        return found is not None and any(a["error"] == "auth" for a in found["attempts"])

    await eventually(failed_for_auth)
    token_fails["on"] = False
    await eventually(lambda: asyncio.sleep(0, accepted(failing)), timeout_s=30)


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


async def test_a_test_event_is_sent_to_one_endpoint_and_its_attempt_shown_at_once(
    system: System, receiver: Receiver
) -> None:
    api = Ingest(system)
    acme = tenant()
    answers = {"/tested": Reply(status=200, headers={"content-type": "text/plain"}, body=b"got it")}
    receiver.responder = lambda request: answers.get(request.path, Reply(status=500, body=b"down"))
    schema = {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 1}}}
    described = await api(
        "POST", "/v1/event-types",
        json={"name": "invoice.paid", "schemas": {"1": schema}, "validation": "enforce",
              "examples": [{"invoice_id": "in_1", "amount": 4200}]},
    )  # fmt: skip
    assert described.status_code == 201, described.text
    endpoint = system.add_endpoint(acme, receiver.url("/tested"), ["order.*"])  # not even subscribed
    failing = system.add_endpoint(acme, receiver.url("/failing"), ["order.*"])
    await set_status(system, endpoint["id"], "pause")  # a paused endpoint can be tested too

    def arrived(path: str) -> list[dict[str, Any]]:
        return [json.loads(r.body) for r in receiver.requests if r.path == path]

    # The catalog's example, signed as every delivery; the attempt in the answer.
    tested = await api("POST", f"/v1/endpoints/{endpoint['id']}/test", json={"type": "invoice.paid"})
    assert tested.status_code == 200, tested.text
    attempt = tested.json()
    assert (attempt["kind"], attempt["status"], attempt["outcome"], attempt["attempt"]) == (
        "test",
        200,
        "success",
        1,
    )
    assert (attempt["type"], attempt["response_body"], attempt["warnings"]) == ("invoice.paid", "got it", [])
    assert attempt["duration_ms"] > 0
    [request] = [r for r in receiver.requests if r.path == "/tested"]
    sent = Webhook(endpoint["secret"]).verify(request.body, request.headers)
    assert (sent["id"], sent["tenant"], sent["data"]) == (
        attempt["event_id"],
        acme,
        {"invoice_id": "in_1", "amount": 4200},
    )

    # Data typed in; the type's enforced schema refuses bad data before anything is sent.
    typed = await api(
        "POST", f"/v1/endpoints/{endpoint['id']}/test",
        json={"type": "invoice.paid", "data": {"amount": 7}, "subject": "in_2"},
    )  # fmt: skip
    assert typed.status_code == 200, typed.text
    refused = await api(
        "POST", f"/v1/endpoints/{endpoint['id']}/test", json={"type": "invoice.paid", "data": {"amount": 0}}
    )
    assert (refused.status_code, refused.json()["error"]) == (422, "invalid_event"), refused.text
    assert [d["field"] for d in refused.json()["details"]] == ["/data/amount"]
    no_example = await api("POST", f"/v1/endpoints/{endpoint['id']}/test", json={"type": "order.created"})
    assert (no_example.status_code, no_example.json()["error"]) == (422, "no_example"), no_example.text
    assert [(e["data"], e.get("subject")) for e in arrived("/tested")] == [
        ({"invoice_id": "in_1", "amount": 4200}, None),
        ({"amount": 7}, "in_2"),
    ]

    # A failing answer is shown as it is; nothing was published, so nothing retries it.
    down = await api("POST", f"/v1/endpoints/{failing['id']}/test", json={"type": "invoice.paid"})
    assert (down.json()["status"], down.json()["outcome"], down.json()["response_body"]) == (
        500,
        "failed",
        "down",
    )
    assert (await api("GET", f"/v1/events/{down.json()['event_id']}")).status_code == 404

    # Another tenant's token finds no such endpoint.
    other = await api(
        "POST", f"/v1/endpoints/{endpoint['id']}/test", token=OTHER_TOKEN, json={"type": "invoice.paid"}
    )
    assert other.status_code == 404, other.text

    # The delivery log keeps the attempts; the audit trail says who tested what.
    async def tests_logged() -> list[dict[str, Any]] | None:
        page = (await api("GET", f"/v1/endpoints/{endpoint['id']}/attempts")).json()["data"]
        return page if len(page) == 2 else None

    logged = await eventually(tests_logged)
    assert [(a["kind"], a["event_id"]) for a in logged] == [
        ("test", typed.json()["event_id"]),
        ("test", attempt["event_id"]),
    ]

    async def audited() -> list[dict[str, Any]] | None:
        records = (await api("GET", "/v1/audit", params={"tenant": acme})).json()["data"]
        found = [r for r in records if r["action"] == "endpoint.tested"]
        return found if len(found) == 3 else None

    assert {r["target"] for r in await eventually(audited)} == {endpoint["id"], failing["id"]}

    # The same from the command line.
    env = {**system.env, "HOOKLINE_INGEST_URL": system.ingest.base_url}
    shown = await asyncio.to_thread(
        subprocess.run,
        [services.HOOKLINE, "endpoints", "test", endpoint["id"], "--type", "invoice.paid", "--data", '{"amount": 9}'],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert (json.loads(shown.stdout)["status"], arrived("/tested")[-1]["data"]) == (200, {"amount": 9})


async def test_a_polling_endpoint_fetches_its_events_in_order_signed_and_is_never_pushed_to(
    system: System, receiver: Receiver
) -> None:
    api = Ingest(system)
    acme = tenant()
    receiver.responder = lambda request: Reply(status=204)
    created = await api(
        "POST", "/v1/endpoints", json={"tenant": acme, "kind": "polling", "event_types": ["order.*"]}
    )
    assert created.status_code == 201, created.text
    polling = created.json()
    assert (polling["kind"], polling["url"], polling["poll_token"][:5]) == ("polling", None, "hlpt_")
    assert "poll_token" not in (await api("GET", f"/v1/endpoints/{polling['id']}")).json()

    async def creation_audited() -> dict[str, Any] | None:
        records = (await api("GET", "/v1/audit", params={"tenant": acme})).json()["data"]
        return next((r for r in records if r["target"] == polling["id"]), None)

    audited = await eventually(creation_audited)  # the token's digest is said to be set, not shown
    assert (audited["action"], audited["changes"]["poll_token_hash"]) == ("endpoint.created", "changed")
    pushed = system.add_endpoint(acme, receiver.url("/pushed"), ["order.*"])  # beside it, as ever
    for refused in (
        {"tenant": acme, "event_types": ["order.*"]},  # a push endpoint needs a url
        {"tenant": acme, "kind": "polling", "event_types": ["#"], "url": receiver.url("/x")},
        {"tenant": acme, "kind": "polling", "event_types": ["#"], "ordered": True},
    ):
        answer = await api("POST", "/v1/endpoints", json=refused)
        assert answer.status_code == 422, (refused, answer.text)

    published = []
    for event_type in ("order.created", "invoice.paid", "order.updated", "order.created", "order.paid"):
        response = await api(
            "POST", "/v1/events", json={"tenant": acme, "type": event_type, "data": {"t": event_type}}
        )
        assert response.status_code == 202, response.text
        published.append((response.json()["id"], event_type))
    orders = [event_id for event_id, event_type in published if event_type.startswith("order.")]

    async def poll(token: str = polling["poll_token"], **params: Any) -> httpx.Response:
        return await api("GET", f"/v1/endpoints/{polling['id']}/poll", token=token, params=params)

    for wrong in ("hlpt_not-the-token", services.TOKEN, OTHER_TOKEN, pushed["secret"]):
        assert (await poll(wrong)).status_code == 401
    assert (
        await api("GET", "/v1/endpoints/ep_01NOSUCHENDPOINT000000000/poll", token=polling["poll_token"])
    ).status_code == 401

    async def waiting_to_be_fetched() -> dict[str, Any] | None:
        found = await api.story(orders[0])
        mine = [c for c in found["endpoints"] if c["endpoint_id"] == polling["id"]] if found else []
        return mine[0] if mine else None

    waiting = await eventually(waiting_to_be_fetched)
    assert (waiting["state"], waiting["attempts"]) == ("pending", [])
    assert "not fetched yet" in waiting["waiting_reason"]

    async def all_four() -> dict[str, Any] | None:  # the ingest's delivery log follows the event log
        page = (await poll(limit=10)).json()
        return page if len(page["data"]) == 4 else None

    await eventually(all_four)
    first = (await poll(limit=3)).json()
    assert ([e["id"] for e in first["data"]], first["done"], first["expired"]) == (orders[:3], False, 0)
    rest = (await poll(limit=3, iterator=first["next_iterator"])).json()
    assert ([e["id"] for e in rest["data"]], rest["done"]) == (orders[3:], True)
    after = (await poll(iterator=rest["next_iterator"])).json()
    assert (after["data"], after["done"], after["next_iterator"]) == ([], True, rest["next_iterator"])
    for polled in [*first["data"], *rest["data"]]:
        event = Webhook(polling["secret"]).verify(polled["body"], polled["headers"])
        assert (event["id"], event["tenant"], event["data"]) == (polled["id"], acme, {"t": polled["type"]})

    # Fetched is delivered, in the delivery log; the push endpoint got its copies; nothing was pushed to
    # the polling one (no dispatcher attempted it).
    async def delivered_by_poll() -> dict[str, Any] | None:
        found = await api.story(orders[0])
        mine = [c for c in found["endpoints"] if c["endpoint_id"] == polling["id"]] if found else []
        return mine[0] if mine and mine[0]["state"] == "delivered" and len(mine[0]["attempts"]) == 2 else None

    # Fetched twice (by the first poll of ten and the poll of three): each fetch is an attempt.
    assert [a["kind"] for a in (await eventually(delivered_by_poll))["attempts"]] == ["poll", "poll"]
    await receiver.wait_for(4, path="/pushed", timeout_s=30)
    attempted = [json.loads(line) for line in system.logs().splitlines() if '"delivery_attempt"' in line]
    assert polling["id"] not in {line.get("endpoint_id") for line in attempted}
    assert pushed["id"] in {line.get("endpoint_id") for line in attempted}

    # What only a push endpoint can do is refused, naming why.
    for method, path, body in (
        ("POST", "pause", None), ("POST", "verify", None), ("POST", "test", {"type": "order.created", "data": {}}),
        ("POST", "replay", {"since": "2026-01-01T00:00:00Z"}), ("PATCH", "", {"url": receiver.url("/y")}),
    ):  # fmt: skip
        refused = await api(method, f"/v1/endpoints/{polling['id']}/{path}".rstrip("/"), json=body)
        assert (refused.status_code, path) == (422, path), refused.text
    patched = await api("PATCH", f"/v1/endpoints/{polling['id']}", json={"event_types": ["order.created"]})
    assert patched.status_code == 200, patched.text
    again = (await poll(limit=10)).json()
    assert [e["id"] for e in again["data"]] == [orders[0], orders[2]]  # from the start, as now subscribed

    # From the command line: one added after those events gets none of them; a deleted one's token is void.
    env = {**system.env, "HOOKLINE_INGEST_URL": system.ingest.base_url}

    def hookline(*arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [services.HOOKLINE, *arguments], env=env, capture_output=True, text=True, timeout=60
        )

    added = await asyncio.to_thread(
        hookline, "endpoints", "add", "--tenant", acme, "--polling", "--event-type", "order.*"
    )
    assert added.returncode == 0, added.stderr
    later = json.loads(added.stdout)
    fetched = await asyncio.to_thread(
        hookline, "endpoints", "poll", later["id"], "--poll-token", later["poll_token"]
    )
    assert fetched.returncode == 0, fetched.stderr
    assert (json.loads(fetched.stdout)["data"], json.loads(fetched.stdout)["done"]) == ([], True)

    # A leaked token is replaced: the old one is void at once.
    rotated = await api("POST", f"/v1/endpoints/{polling['id']}/rotate-poll-token")
    assert rotated.status_code == 200, rotated.text
    assert (await poll()).status_code == 401
    assert (await poll(rotated.json()["poll_token"], limit=1)).status_code == 200
    assert (
        await api("POST", f"/v1/endpoints/{polling['id']}/rotate-poll-token", token=OTHER_TOKEN)
    ).status_code == 404
    assert (await api("POST", f"/v1/endpoints/{pushed['id']}/rotate-poll-token")).status_code == 422

    assert (await api("DELETE", f"/v1/endpoints/{polling['id']}")).status_code == 204
    assert (await poll(rotated.json()["poll_token"])).status_code == 401


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


SSRF_ENV = {"HOOKLINE_ALLOW_PRIVATE_TARGETS": "false"}


@pytest.fixture
def lenient_ingest(own_system: System, tmp_path: Path) -> Iterator[services.Service]:
    """An ingest that allows private targets, as if a bad endpoint had been registered somehow."""
    ingest = services.start(
        "ingest",
        {**own_system.env, "HOOKLINE_ALLOW_PRIVATE_TARGETS": "true"},
        tmp_path,
        name="ingest-lenient",
    )
    try:
        ingest.wait_ready()
        yield ingest
    finally:
        assert ingest.stop() == 0


@pytest.mark.system_env(SSRF_ENV)
async def test_a_private_target_is_refused_at_delivery_time(
    own_system: System, receiver: Receiver, lenient_ingest: services.Service
) -> None:
    system = own_system  # the settings of its own (system_env)
    acme = tenant()
    response = await asyncio.to_thread(
        httpx.post,
        lenient_ingest.base_url + "/v1/endpoints",
        headers={"authorization": f"Bearer {services.TOKEN}"},
        json={"tenant": acme, "url": receiver.url("/private"), "event_types": ["#"], "verify": False},
    )
    assert response.status_code == 201, response.text
    endpoint = response.json()
    await publish_event(system.amqp_url, event(acme, "a.b", "evt_private_1"), f"{acme}.a.b")

    async def dead() -> list[dict[str, object]] | None:
        with system.api() as api:
            items = api.get("/v1/dead-letters", params={"endpoint_id": endpoint["id"]}).json()["data"]
        return items or None

    [item] = await eventually(dead)
    assert item["reason"] == "permanent_status"
    assert "loopback" in str(item["last_error"])
    await eventually(lambda: asyncio.to_thread(lambda: '"error":"refused_target"' in system.logs()))
    assert receiver.requests == [], "the private address was never connected to"
