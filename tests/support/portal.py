"""Portal links and sessions through the ingest's API, for the portal's tests (the subprocess system's
and the in-process ingest's alike: each has ``ingest.base_url``)."""

from __future__ import annotations

from typing import Any, Protocol

import httpx

from support import services


class _Served(Protocol):
    @property
    def base_url(self) -> str: ...


class WithIngest(Protocol):
    @property
    def ingest(self) -> _Served: ...


async def api(
    system: WithIngest, method: str, path: str, *, token: str = services.TOKEN, **kwargs: Any
) -> httpx.Response:
    async with httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {token}"}, timeout=30
    ) as client:
        return await client.request(method, path, **kwargs)


async def link(system: WithIngest, token: str = services.TOKEN, **spec: Any) -> dict[str, Any]:
    made = await api(system, "POST", "/v1/portal/sessions", token=token, json={"tenant": "acme", **spec})
    assert made.status_code == 201, made.text
    found: dict[str, Any] = made.json()
    assert found["url"].startswith("http://127.0.0.1:8001/portal/open/hlpl_")  # HOOKLINE_PORTAL_URL's default
    return found


async def session_of(system: WithIngest, made: dict[str, Any]) -> str:
    opened = await api(system, "POST", "/v1/portal/open", json={"link": made["url"].rsplit("/", 1)[1]})
    assert opened.status_code == 200, opened.text
    session: str = opened.json()["session"]
    return session
