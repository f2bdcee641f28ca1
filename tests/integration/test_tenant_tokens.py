"""Tenant-scoped tokens at the API (the ingest in-process, on the real broker): a tenant token sees and
publishes for its tenant only, and only the admin may skip an endpoint's verification. The module runs
with HOOKLINE_SECRET_KEY set, as tests/e2e/test_security.py does (verification, rotation and sealed
secrets, which need dispatchers delivering)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from support.inprocess import IngestSystem

pytestmark = pytest.mark.integration

TENANT_TOKEN = "acme-tenant-token-0123456789"
SYSTEM_ENV = {
    "HOOKLINE_SECRET_KEY": "a-long-random-secret-key-for-the-tests-0123456789",
    "HOOKLINE_TENANT_TOKENS": f"acme:{TENANT_TOKEN}",
}


def test_a_tenant_token_sees_and_publishes_for_its_tenant_only(system: IngestSystem) -> None:
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


def test_only_the_admin_may_skip_verification(system: IngestSystem) -> None:
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
