"""Per-endpoint headers and auth at registration (the ingest in-process, on the real broker): reserved
headers, header injection and bad credentials are refused naming the field. What a receiver gets on
every delivery (basic, bearer, OAuth2) is tests/e2e/test_security.py."""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import pytest
from support import services
from support.inprocess import IngestSystem
from support.receiver import Receiver
from support.system import tenant

pytestmark = pytest.mark.integration

SECRET_KEY = secrets.token_urlsafe(32)
SYSTEM_ENV = {"HOOKLINE_SECRET_KEY": SECRET_KEY}


def client(system: IngestSystem) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=30
    )


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
    system: IngestSystem, receiver: Receiver, fields: dict[str, Any], field: str
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
