"""Conditional API writes (the ingest in-process, on the real broker): ``If-Match`` with the ``ETag`` of
a read makes a change conditional, so that of concurrent changes based on one version exactly one
applies and the others are told 409. The races between the API and the other writers of an endpoint (a
dispatcher, the health monitor, a verification) are tests/e2e/test_concurrent_writes.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support import services
from support.inprocess import IngestSystem
from support.system import tenant

pytestmark = pytest.mark.integration


async def test_conditional_api_writes_let_exactly_one_of_concurrent_changes_win(system: IngestSystem) -> None:
    """``If-Match`` with the ``ETag`` of a read makes a change conditional: of ten concurrent changes
    based on one version exactly one applies and nine are told 409 ``endpoint_changed``; a change based
    on an older version is refused; without ``If-Match`` a change still applies. The version counts
    applied changes only."""
    endpoint = system.add_endpoint(tenant(), "http://127.0.0.1:9/conditional", ["#"])
    path = f"/v1/endpoints/{endpoint['id']}"
    with system.api() as api:
        read = api.get(path)
    base = read.json()["version"]
    assert read.headers["etag"] == f'"{base}"'

    headers = {"authorization": f"Bearer {services.TOKEN}", "if-match": read.headers["etag"]}
    async with httpx.AsyncClient(base_url=system.ingest.base_url, headers=headers, timeout=30) as client:
        answers = await asyncio.gather(
            *(client.patch(path, json={"description": f"writer {n}"}) for n in range(10))
        )
    assert sorted(answer.status_code for answer in answers) == [200] + [409] * 9, [a.text for a in answers]
    [winner] = [answer for answer in answers if answer.status_code == 200]
    assert all(a.json()["error"] == "endpoint_changed" for a in answers if a.status_code == 409)
    assert winner.json()["version"] == base + 1
    assert winner.headers["etag"] == f'"{base + 1}"'

    with system.api() as api:
        stored = api.get(path)
        assert (stored.json()["description"], stored.json()["version"]) == (
            winner.json()["description"],
            base + 1,
        )
        assert stored.headers["etag"] == f'"{base + 1}"'

        # Based on a version that is no longer current: refused, nothing changes.
        stale = api.patch(path, json={"description": "stale"}, headers={"if-match": read.headers["etag"]})
        assert (stale.status_code, stale.json()["error"]) == (409, "endpoint_changed")
        stale_rotation = api.post(f"{path}/rotate-secret", headers={"if-match": f'"{base}"'})
        assert (stale_rotation.status_code, stale_rotation.json()["error"]) == (409, "endpoint_changed")
        assert api.post(f"{path}/pause", headers={"if-match": f'"{base}"'}).status_code == 409
        assert api.patch(path, json={"description": "x"}, headers={"if-match": "soon"}).status_code == 400
        unchanged = api.get(path).json()
        assert (unchanged["description"], unchanged["version"]) == (winner.json()["description"], base + 1)

        # Without If-Match: based on what the request read, and applied.
        free = api.patch(path, json={"description": "no if-match"})
        assert free.status_code == 200, free.text
        assert free.json()["version"] == base + 2
        # The current version, weak or strong, is accepted.
        weak = api.patch(path, json={"description": "weak"}, headers={"if-match": f'W/"{base + 2}"'})
        assert (weak.status_code, weak.json()["version"]) == (200, base + 3)
        final = api.get(path)
    assert (final.json()["description"], final.json()["version"]) == ("weak", base + 3)
    assert final.headers["etag"] == f'"{base + 3}"'
