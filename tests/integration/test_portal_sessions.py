"""Customer portal links and sessions as the ingest scopes them (in-process, on the real broker): made by
the admin or a tenant's token for its own tenant, opened once, a session limited to its tenant, some
endpoints, or reading only; expired and revoked; made from the command line too; audited with the
session as the actor. The portal's pages (on the health monitor, in a browser) are
tests/e2e/test_portal.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
from datetime import UTC, datetime

import pytest
from support import services
from support.inprocess import IngestSystem
from support.portal import api, link, session_of
from support.receiver import Receiver
from support.waiting import eventually

pytestmark = pytest.mark.integration

ACME_TOKEN = "acme-tenant-token-0123456789"
GLOBEX_TOKEN = "globex-tenant-token-0123456789"
SYSTEM_ENV = {
    "HOOKLINE_TENANT_TOKENS": f"acme:{ACME_TOKEN},globex:{GLOBEX_TOKEN}",
    "HOOKLINE_SECRET_KEY": "a-long-random-secret-key-for-the-tests-0123456789",
}


async def test_portal_sessions_are_scoped_by_the_ingest(system: IngestSystem, receiver: Receiver) -> None:
    ok = system.add_endpoint("acme", receiver.url("/ok"), ["order.*"])
    other = system.add_endpoint("acme", receiver.url("/other"), ["order.*"])
    hidden = system.add_endpoint("globex", receiver.url("/globex"), ["order.*"])

    # Made by the admin, or by a tenant's token for its own tenant only; endpoints must be the tenant's.
    assert (
        await api(system, "POST", "/v1/portal/sessions", token=GLOBEX_TOKEN, json={"tenant": "acme"})
    ).status_code == 403
    foreign = await api(
        system, "POST", "/v1/portal/sessions", json={"tenant": "acme", "endpoint_ids": [hidden["id"]]}
    )
    assert (foreign.status_code, foreign.json()["error"]) == (422, "invalid_fields"), foreign.text
    made = await link(system, token=ACME_TOKEN)

    # The link opens once; it is not a credential of the API itself.
    key = made["url"].rsplit("/", 1)[1]
    assert (await api(system, "GET", "/v1/endpoints", token=key)).status_code == 401
    session = await session_of(system, made)
    again = await api(system, "POST", "/v1/portal/open", json={"link": key})
    assert (again.status_code, again.json()["error"]) == (410, "link_used"), again.text

    # Opened five times at once, a link opens one session: the change log's order decides which.
    raced = (await link(system))["url"].rsplit("/", 1)[1]
    answers = await asyncio.gather(
        *(api(system, "POST", "/v1/portal/open", json={"link": raced}) for _ in range(5))
    )
    assert sorted(a.status_code for a in answers) == [200, 410, 410, 410, 410]

    # The session sees its tenant's endpoints, and may not publish, nor touch tokens or the catalog.
    listed = (await api(system, "GET", "/v1/endpoints", token=session)).json()["data"]
    assert {e["id"] for e in listed} == {ok["id"], other["id"]}
    assert (await api(system, "GET", f"/v1/endpoints/{hidden['id']}", token=session)).status_code == 404
    for method, path, body in [
        ("POST", "/v1/events", {"tenant": "acme", "type": "order.created", "data": {}}),
        ("GET", "/v1/tokens", None),
        ("POST", "/v1/event-types", {"name": "order.made"}),
        ("POST", "/v1/portal/sessions", {"tenant": "acme"}),
    ]:
        refused = await api(system, method, path, token=session, json=body)
        assert (refused.status_code, refused.json()["error"]) == (403, "forbidden"), (path, refused.text)
    paused = await api(system, "POST", f"/v1/endpoints/{ok['id']}/pause", token=session)
    assert paused.status_code == 200, paused.text
    assert (await api(system, "POST", f"/v1/endpoints/{ok['id']}/resume", token=session)).status_code == 200

    # Limited to one endpoint: the other is not there, and none can be added.
    limited = await session_of(system, await link(system, endpoint_ids=[ok["id"]]))
    assert [e["id"] for e in (await api(system, "GET", "/v1/endpoints", token=limited)).json()["data"]] == [
        ok["id"]
    ]
    assert (await api(system, "GET", f"/v1/endpoints/{other['id']}", token=limited)).status_code == 404
    assert (await api(system, "POST", f"/v1/endpoints/{other['id']}/pause", token=limited)).status_code == 404
    adding = await api(
        system,
        "POST",
        "/v1/endpoints",
        token=limited,
        json={"tenant": "acme", "url": receiver.url("/x"), "event_types": ["*"]},
    )
    assert adding.status_code == 403, adding.text

    # Read-only: it reads, and changes nothing (a secret is not shown either).
    reader = await session_of(system, await link(system, read_only=True))
    assert (await api(system, "GET", f"/v1/endpoints/{ok['id']}", token=reader)).status_code == 200
    for method, path in [
        ("POST", f"/v1/endpoints/{ok['id']}/pause"),
        ("GET", f"/v1/endpoints/{ok['id']}/secret"),
        ("DELETE", f"/v1/endpoints/{ok['id']}"),
    ]:
        refused = await api(system, method, path, token=reader)
        assert (refused.status_code, refused.json()["message"]) == (
            403,
            "this portal session is read-only",
        ), refused.text

    # Expired (its expiry set to now), a link does not open; revoked, a session ends at once.
    late = await link(system)
    assert (
        await api(
            system, "PATCH", f"/v1/tokens/{late['id']}", json={"expires_at": datetime.now(UTC).isoformat()}
        )
    ).status_code == 200
    expired = await api(system, "POST", "/v1/portal/open", json={"link": late["url"].rsplit("/", 1)[1]})
    assert expired.status_code == 401, expired.text
    revoked_id = "pls_" + made["id"].removeprefix("pll_")
    assert (await api(system, "DELETE", f"/v1/tokens/{revoked_id}")).status_code == 204
    assert (await api(system, "GET", "/v1/endpoints", token=session)).status_code == 401

    # The same link from the command line.
    env = {**system.env, "HOOKLINE_INGEST_URL": system.ingest.base_url}
    made_by_cli = await asyncio.to_thread(
        subprocess.run,
        [services.HOOKLINE, "portal", "link", "--tenant", "acme", "--endpoint-id", ok["id"], "--read-only"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made_by_cli.returncode == 0, made_by_cli.stderr
    cli_session = await session_of(system, json.loads(made_by_cli.stdout))
    identity = (await api(system, "GET", "/v1/whoami", token=cli_session)).json()
    assert identity["portal"] == {"role": "session", "endpoint_ids": [ok["id"]], "read_only": True}

    # The audit trail names the portal session as the actor of what it did.
    async def audited() -> list[tuple[str, str]] | None:
        records = (await api(system, "GET", "/v1/audit", params={"tenant": "acme"})).json()["data"]
        found = [(r["action"], r["actor"]) for r in records if r["actor"] == f"portal:{revoked_id}"]
        return found if len(found) == 3 else None

    assert sorted(await eventually(audited)) == [
        ("endpoint.paused", f"portal:{revoked_id}"),
        ("endpoint.resumed", f"portal:{revoked_id}"),
        ("portal.link_used", f"portal:{revoked_id}"),
    ]
