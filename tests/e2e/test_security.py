"""Endpoint lifecycle and security with the real services: verification, rotation, sealed secrets,
tenant-scoped tokens. The whole module runs with HOOKLINE_SECRET_KEY set (secrets sealed at rest)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

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


def test_a_tenant_token_sees_and_publishes_for_its_tenant_only(system: System) -> None:
    other = system.add_endpoint("globex", "http://127.0.0.1:9/x", ["#"])
    mine = system.add_endpoint("acme", "http://127.0.0.1:9/y", ["#"])
    headers = {"authorization": f"Bearer {TENANT_TOKEN}"}
    with httpx.Client(base_url=system.ingest.base_url, headers=headers, timeout=30) as api:
        listed = api.get("/v1/endpoints").json()["data"]
        assert {item["tenant"] for item in listed} == {"acme"}
        assert mine["id"] in {item["id"] for item in listed}
        assert api.get("/v1/endpoints", params={"tenant": "globex"}).status_code == 403
        assert api.get(f"/v1/endpoints/{other['id']}").status_code == 404, (
            "another tenant's endpoint is not found"
        )
        assert api.delete(f"/v1/endpoints/{other['id']}").status_code == 404
        assert (
            api.post(
                f"/v1/endpoints/{other['id']}/replay", json={"since": "2026-01-01T00:00:00Z"}
            ).status_code
            == 404
        )
        created = api.post(
            "/v1/endpoints", json={"tenant": "globex", "url": "http://127.0.0.1:9/z", "event_types": ["#"]}
        )
        assert created.status_code == 403
        assert created.json()["error"] == "forbidden"
        published = api.post("/v1/events", json={"tenant": "globex", "type": "a.b", "data": {}})
        assert published.status_code == 403
        assert api.post("/v1/events", json={"tenant": "acme", "type": "a.b", "data": {}}).status_code == 202
        dead: dict[str, Any] = api.get("/v1/dead-letters").json()
        assert all(item["tenant"] == "acme" for item in dead["data"])


def test_only_the_admin_may_skip_verification(system: System) -> None:
    mine = system.add_endpoint("acme", "http://127.0.0.1:9/unverified-by-admin", ["#"])
    assert mine["verified"] is True  # the admin skipped the handshake
    headers = {"authorization": f"Bearer {TENANT_TOKEN}"}
    with httpx.Client(base_url=system.ingest.base_url, headers=headers, timeout=30) as api:
        spec = {"tenant": "acme", "url": "http://127.0.0.1:9/third-party", "event_types": ["#"]}
        created = api.post("/v1/endpoints", json={**spec, "verify": False})
        assert created.status_code == 403
        assert created.json()["error"] == "forbidden"
        assert "verify" in created.json()["message"]
        moved = api.patch(f"/v1/endpoints/{mine['id']}", json={"url": spec["url"], "verify": False})
        assert moved.status_code == 403
        # Verified (the default), the tenant may register it: the handshake decides.
        assert api.post("/v1/endpoints", json=spec).status_code == 201
