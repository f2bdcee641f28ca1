"""A polling endpoint's filter (the ingest in-process, on the real broker): the endpoint fetches only
the events its CEL filter matches. Filters on pushed deliveries are tests/e2e/test_filters.py."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from support import services
from support.inprocess import IngestSystem
from support.waiting import eventually

pytestmark = pytest.mark.integration


async def api(system: IngestSystem, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}, timeout=60
    ) as client:
        return await client.request(method, path, **kwargs)


async def test_a_polling_endpoint_fetches_only_what_its_filter_matches(system: IngestSystem) -> None:
    created = await api(
        system, "POST", "/v1/endpoints",
        json={"tenant": "globex", "kind": "polling", "event_types": ["order.*"], "filter": "data.amount >= 1000"},
    )  # fmt: skip
    assert created.status_code == 201, created.text
    polling = created.json()
    amounts = [500, 1500, 900, 2500, 1000]
    for n, amount in enumerate(amounts):
        published = await api(
            system, "POST", "/v1/events",
            json={"tenant": "globex", "type": "order.created", "subject": f"p_{n}", "data": {"amount": amount}},
        )  # fmt: skip
        assert published.status_code == 202, published.text

    async def fetched() -> list[str] | None:
        async with httpx.AsyncClient(
            base_url=system.ingest.base_url, headers={"authorization": f"Bearer {polling['poll_token']}"}
        ) as client:
            page = (await client.get(f"/v1/endpoints/{polling['id']}/poll", params={"limit": 50})).json()
        subjects = [json.loads(event["body"])["subject"] for event in page["data"]]
        return subjects if "p_4" in subjects else None  # the last one published: all are in the log

    assert await eventually(fetched, timeout_s=30) == ["p_1", "p_3", "p_4"]
