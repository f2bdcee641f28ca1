"""Tenants as the admin runs them: tokens as data, quotas, the audit trail — across ingest replicas
(in-process, on the real broker)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from support.inprocess import IngestSystem, InProcessIngest, another_ingest
from support.system import tenant
from support.waiting import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
def second_ingest(system: IngestSystem) -> Iterator[InProcessIngest]:
    """Another ingest replica on the same broker (its own view files)."""
    with another_ingest(system, "ingest-2") as ingest:
        yield ingest


def _client(base_url: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=base_url, headers={"authorization": f"Bearer {token}"}, timeout=30)


def _publish(api: httpx.Client, acme: str, event_id: str, **data: Any) -> httpx.Response:
    return api.post("/v1/events", json={"id": event_id, "tenant": acme, "type": "a.b", "data": data})


async def test_a_token_works_on_every_replica_until_revoked_and_is_shown_once(
    system: IngestSystem, second_ingest: InProcessIngest
) -> None:
    acme = tenant()
    with system.api() as admin:
        created = admin.post("/v1/tokens", json={"tenant": acme, "description": "orders service"})
        assert created.status_code == 201, created.text
        token = created.json()
        secret = token["token"]
        assert secret.startswith(token["prefix"])
        assert len(secret) >= 40
        listed = admin.get("/v1/tokens", params={"tenant": acme}).json()["data"]
        assert [(t["id"], t["prefix"], t["active"]) for t in listed] == [(token["id"], token["prefix"], True)]
        assert secret not in admin.get("/v1/tokens").text, "a token is shown once, never listed"

    # Another replica knows it once it has followed the change log to it (milliseconds; the deadline
    # is for a loaded machine), limited to its tenant.
    with _client(second_ingest.base_url, secret) as api:

        async def known() -> bool:
            return (await asyncio.to_thread(api.get, "/v1/whoami")).status_code == 200

        await eventually(known)
        assert api.get("/v1/whoami").json() == {"admin": False, "tenant": acme, "portal": None}
        assert _publish(api, acme, "evt_token_1").status_code == 202
        assert _publish(api, "someone-else", "evt_token_2").status_code == 403
        assert api.get("/v1/tokens").status_code == 403, "tokens are the admin's"
        assert api.post("/v1/tokens", json={"tenant": acme}).status_code == 403

    with system.api() as admin:
        assert admin.delete(f"/v1/tokens/{token['id']}").status_code == 204
        [revoked] = admin.get("/v1/tokens", params={"tenant": acme}).json()["data"]
        assert revoked["active"] is False
        assert revoked["revoked_at"] is not None

    async def refused_everywhere() -> bool:
        codes = set()
        for base_url in (system.ingest.base_url, second_ingest.base_url):
            with _client(base_url, secret) as api:
                codes.add((await asyncio.to_thread(api.get, "/v1/whoami")).status_code)
        return codes == {401}

    await eventually(refused_everywhere, timeout_s=5)


def test_an_expired_token_is_refused(system: IngestSystem) -> None:
    acme = tenant()
    with system.api() as admin:
        token = admin.post("/v1/tokens", json={"tenant": acme}).json()
        with _client(system.ingest.base_url, token["token"]) as api:
            assert api.get("/v1/whoami").status_code == 200
            past = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
            expired = admin.patch(f"/v1/tokens/{token['id']}", json={"expires_at": past})
            assert expired.status_code == 200
            assert expired.json()["active"] is False
            assert api.get("/v1/whoami").status_code == 401


def test_a_tenant_is_held_to_its_quota(system: IngestSystem) -> None:
    acme = tenant()
    with system.api() as admin:
        quota = {"max_endpoints": 1, "events_per_s": 0.1, "burst": 3, "bytes_per_day": None}
        assert admin.put(f"/v1/tenants/{acme}/quota", json=quota).status_code == 200
        token = admin.post("/v1/tokens", json={"tenant": acme}).json()["token"]
    with _client(system.ingest.base_url, token) as api:
        assert api.put(f"/v1/tenants/{acme}/quota", json={"max_endpoints": 100}).status_code == 403
        spec = {"tenant": acme, "url": "http://127.0.0.1:9/q", "event_types": ["#"]}
        assert api.post("/v1/endpoints", json=spec).status_code == 201
        refused = api.post("/v1/endpoints", json=spec)
        assert refused.status_code == 429
        assert refused.json()["error"] == "quota_exceeded"
        assert "max_endpoints" in refused.json()["message"]
        assert int(refused.headers["retry-after"]) >= 1

        # A burst of 3, then one every 10 s: the 4th is refused, told when to come back.
        answers = [_publish(api, acme, f"evt_rate_{n}") for n in range(4)]
        assert [a.status_code for a in answers[:3]] == [202, 202, 202]
        assert answers[3].status_code == 429
        assert answers[3].json()["error"] == "quota_exceeded"
        assert 1 <= int(answers[3].headers["retry-after"]) <= 10
        # A retry of an accepted event is answered as a duplicate, not refused for the rate.
        again = _publish(api, acme, "evt_rate_0")
        assert again.status_code == 200
        assert again.json()["duplicate"] is True
        seen = api.get(f"/v1/tenants/{acme}/quota").json()
        assert seen["quota"]["max_endpoints"] == 1
        assert seen["usage"]["endpoints"] == 1


async def test_bytes_per_day_counts_what_the_tenant_published(system: IngestSystem) -> None:
    acme = tenant()
    with system.api() as admin:
        assert admin.put(f"/v1/tenants/{acme}/quota", json={"bytes_per_day": 3000}).status_code == 200
        assert _publish(admin, acme, "evt_bytes_1", blob="x" * 1500).status_code == 202

        async def counted() -> bool:
            usage = (await asyncio.to_thread(admin.get, f"/v1/tenants/{acme}/quota")).json()["usage"]
            return bool(usage["bytes_today"] >= 1500 and usage["events_today"] == 1)

        await eventually(counted, timeout_s=10)
        refused = _publish(admin, acme, "evt_bytes_2", blob="x" * 1600)
        assert refused.status_code == 429
        assert "bytes_per_day" in refused.json()["message"]
        assert 0 < int(refused.headers["retry-after"]) <= 86_400
        assert _publish(admin, acme, "evt_bytes_3", blob="small").status_code == 202

        # A batch is counted item by item, each seeing the others: 3 × 1 KB against what is left.
        with system.api() as api:
            response = api.post(
                "/v1/events/batch",
                json={
                    "events": [
                        {"tenant": acme, "type": "a.b", "data": {"blob": "y" * 1000}} for _ in range(3)
                    ]
                },
            )
        statuses = [item["status"] for item in response.json()["results"]]
        assert statuses.count(202) <= 1, statuses
        refused = [item for item in response.json()["results"] if item["status"] == 429]
        assert refused
        assert all(item["retry_after_s"] > 0 for item in refused)


async def test_every_change_is_in_the_audit_trail_with_who_made_it(system: IngestSystem) -> None:
    acme = tenant()
    since = datetime.now(UTC).isoformat()
    with system.api() as admin:
        token = admin.post("/v1/tokens", json={"tenant": acme}).json()
    with _client(system.ingest.base_url, token["token"]) as api:
        spec = {"tenant": acme, "url": "http://127.0.0.1:9/audited", "event_types": ["#"]}
        endpoint = api.post(
            "/v1/endpoints", json={**spec, "headers": {"x-api-key": "not-for-the-trail"}}
        ).json()
        assert (
            api.patch(f"/v1/endpoints/{endpoint['id']}", json={"description": "renamed"}).status_code == 200
        )
        assert api.post(f"/v1/endpoints/{endpoint['id']}/pause").status_code == 200
        assert api.post(f"/v1/endpoints/{endpoint['id']}/rotate-secret").status_code == 200
        replayed = api.post(f"/v1/endpoints/{endpoint['id']}/replay", json={"since": since})
        assert replayed.status_code == 200, replayed.text
        assert api.delete(f"/v1/endpoints/{endpoint['id']}").status_code == 204
    with system.api() as admin:
        assert admin.delete(f"/v1/tokens/{token['id']}").status_code == 204

        async def trail() -> list[dict[str, Any]] | None:
            response = await asyncio.to_thread(
                admin.get, "/v1/audit", params={"tenant": acme, "since": since}
            )
            records: list[dict[str, Any]] = response.json()["data"]
            return records if [r["action"] for r in records][-1:] == ["token.revoked"] else None

        records = await eventually(trail, timeout_s=10)
    assert [r["action"] for r in records] == [
        "token.created",
        "endpoint.created",
        "endpoint.updated",
        "endpoint.paused",
        "endpoint.secret_rotated",
        "endpoint.replayed",
        "endpoint.deleted",
        "token.revoked",
    ]
    by_token = f"token:{token['id']}"
    assert [r["actor"] for r in records] == ["admin", *[by_token] * 6, "admin"]
    assert records[2]["changes"] == {"description": {"from": "", "to": "renamed"}}
    assert records[4]["changes"] == {"secrets": "changed"}
    assert all(r["target"] == endpoint["id"] for r in records[1:7])
    assert records[5]["changes"]["replayed"] == 0
    everything = str(records)
    assert "not-for-the-trail" not in everything
    assert "whsec_" not in everything
    assert "enc:v" not in everything

    # A tenant token sees its own tenant's trail only; pages follow each other.
    other = tenant()
    with system.api() as admin:
        other_token = admin.post("/v1/tokens", json={"tenant": other}).json()["token"]
        first = admin.get("/v1/audit", params={"tenant": acme, "since": since, "limit": 5}).json()
        rest = admin.get(
            "/v1/audit", params={"tenant": acme, "since": since, "after": first["next_after"]}
        ).json()
        assert [r["id"] for r in first["data"] + rest["data"]] == [r["id"] for r in records]
    with _client(system.ingest.base_url, other_token) as api:
        assert api.get("/v1/audit", params={"tenant": acme}).status_code == 403

        async def own_trail() -> list[dict[str, Any]] | None:
            records: list[dict[str, Any]] = (await asyncio.to_thread(api.get, "/v1/audit")).json()["data"]
            return records or None

        own = await eventually(own_trail, timeout_s=10)
    assert [(r["action"], r["tenant"]) for r in own] == [("token.created", other)]
    assert own[0]["changes"]["prefix"] == other_token[:12]
