"""SSRF protection with the real services: should a private target get registered anyway, it is refused
at delivery time, as a permanent failure with the reason. The refusals at registration are
tests/integration/test_ssrf_registration.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import services
from support.amqp import event, publish_event
from support.receiver import Receiver
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

SYSTEM_ENV = {"HOOKLINE_ALLOW_PRIVATE_TARGETS": "false"}


@pytest.fixture
def lenient_ingest(system: System, tmp_path: Path) -> Iterator[services.Service]:
    """An ingest that allows private targets, as if a bad endpoint had been registered somehow."""
    ingest = services.start(
        "ingest", {**system.env, "HOOKLINE_ALLOW_PRIVATE_TARGETS": "true"}, tmp_path, name="ingest-lenient"
    )
    try:
        ingest.wait_ready()
        yield ingest
    finally:
        assert ingest.stop() == 0


async def test_a_private_target_is_refused_at_delivery_time(
    system: System, receiver: Receiver, lenient_ingest: services.Service
) -> None:
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
