"""Endpoint lifecycle and security with the real services: verification, rotation, sealed secrets, a
dispatcher refusing a wrong key; and per-endpoint headers and auth as a customer whose receiver sits
behind an API gateway sees them (from test_endpoint_auth.py): its own headers and credentials on every
delivery (basic, bearer, an OAuth2 client-credentials token fetched once, refreshed on a 401 without
spending an attempt), never shown back by the API, sealed at rest. The whole module runs with
HOOKLINE_SECRET_KEY set (secrets sealed at rest). At the API alone (integration tests): tenant-scoped
tokens, tests/integration/test_tenant_tokens.py; reserved headers and bad auth refused,
tests/integration/test_endpoint_auth.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
from support import services
from support.amqp import event, publish_event, read_stream
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

TENANT_TOKEN = "acme-tenant-token-0123456789"
SYSTEM_ENV = {
    "HOOKLINE_SECRET_KEY": "a-long-random-secret-key-for-the-tests-0123456789",
    "HOOKLINE_TENANT_TOKENS": f"acme:{TENANT_TOKEN}",
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
