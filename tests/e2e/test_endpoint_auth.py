"""Per-endpoint headers and auth, as a customer whose receiver sits behind an API gateway sees them:
its own headers and credentials on every delivery (basic, bearer, an OAuth2 client-credentials token
fetched once, refreshed on a 401 without spending an attempt), never shown back by the API, sealed
at rest; reserved headers refused."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
from support import services
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

SECRET_KEY = secrets.token_urlsafe(32)
SYSTEM_ENV = {"HOOKLINE_SECRET_KEY": SECRET_KEY}


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


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"headers": {"webhook-id": "x"}}, "headers"),
        ({"headers": {"Authorization": "Bearer x"}}, "headers"),
        ({"headers": {"Content-Type": "text/plain"}}, "headers"),
        ({"headers": {"X-Hookline-Attempt": "1"}}, "headers"),
        ({"headers": {"X-A": "a", "x-a": "b"}}, "headers"),
        ({"headers": {"X-Bad": "line\r\nInjected: 1"}}, "headers.X-Bad"),
        ({"auth": {"type": "basic", "username": "a:b", "password": "p"}}, "auth.basic.username"),
        ({"auth": {"type": "kerberos"}}, "auth"),
        ({"auth": {"type": "mtls", "certificate": "not a pem", "private_key": "nor this"}}, "auth"),
    ],
)
async def test_reserved_headers_and_bad_auth_are_refused(
    system: System, receiver: Receiver, fields: dict[str, Any], field: str
) -> None:
    async with client(system) as api:
        answer = await api.post(
            "/v1/endpoints",
            json={
                "tenant": tenant(),
                "url": receiver.url("/x"),
                "event_types": ["order.*"],
                "verify": False,
                **fields,
            },
        )
    assert answer.status_code == 422, answer.text
    assert any(detail["field"] == field for detail in answer.json()["details"]), answer.text


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
