"""Bad input to the API gets a clear answer naming the problem (the ingest in-process, on the real
broker), the operator's reserved tenant among it (from e2e test_notifications.py). What is published to
AMQP as garbage is dead-lettered by a dispatcher: tests/e2e/test_delivery_path.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
from support import services
from support.inprocess import IngestSystem, InProcessIngest, another_ingest
from support.system import tenant

pytestmark = pytest.mark.integration


def test_every_api_route_needs_the_token(system: IngestSystem) -> None:
    for method, path in (
        ("GET", "/v1/endpoints"),
        ("POST", "/v1/events"),
        ("POST", "/v1/endpoints"),
        ("GET", "/v1/endpoints/ep_01M8MBRFFNGXMBJCZR93584RNZ"),
    ):
        for headers in (
            {},
            {"authorization": "Bearer wrong-token-but-long-enough"},
            {"authorization": services.TOKEN},
        ):
            response = httpx.request(method, system.ingest.base_url + path, headers=headers, json={})
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"] == "unauthorized"
            assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(
    ("body", "status", "error", "fields"),
    [
        (b"{not json", 400, "malformed_json", None),
        (b"", 400, "malformed_json", None),
        (
            json.dumps({"tenant": "acme", "type": "Order Created", "data": {}}).encode(),
            422,
            "invalid_fields",
            {"type"},
        ),
        (
            json.dumps({"tenant": "a.b", "type": "x", "data": []}).encode(),
            422,
            "invalid_fields",
            {"tenant", "data"},
        ),
        (json.dumps({"type": "x", "data": {}}).encode(), 422, "invalid_fields", {"tenant"}),
        (
            json.dumps({"tenant": "acme", "type": "x", "data": {}, "colour": 1}).encode(),
            422,
            "invalid_fields",
            {"colour"},
        ),
        (
            json.dumps({"tenant": "acme", "type": "x", "data": {}, "id": "has space"}).encode(),
            422,
            "invalid_fields",
            {"id"},
        ),
        (
            json.dumps({"tenant": "acme", "type": "x", "data": {"blob": "x" * 300_000}}).encode(),
            413,
            "payload_too_large",
            None,
        ),
    ],
)
def test_bad_events_are_refused_naming_the_problem(
    system: IngestSystem, body: bytes, status: int, error: str, fields: set[str] | None
) -> None:
    with system.api() as api:
        response = api.post("/v1/events", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    answer = response.json()
    assert answer["error"] == error
    assert answer["message"]
    if fields is not None:
        assert {detail["field"] for detail in answer["details"]} == fields
        assert all(field in answer["message"] for field in fields)
    assert "Traceback" not in response.text


def test_bad_endpoints_are_refused_naming_the_field(system: IngestSystem) -> None:
    with system.api() as api:
        response = api.post(
            "/v1/endpoints", json={"tenant": "acme", "url": "ftp://x", "event_types": ["Bad"]}
        )
        assert response.status_code == 422
        assert {d["field"] for d in response.json()["details"]} == {"url", "event_types.0"}
        assert api.get("/v1/endpoints/ep_01M8MBRFFNGXMBJCZR93584RNZ").status_code == 404
        assert (
            api.patch("/v1/endpoints/ep_01M8MBRFFNGXMBJCZR93584RNZ", json={"url": "https://x/"}).status_code
            == 404
        )


@pytest.fixture
def strict_ingest(system: IngestSystem) -> Iterator[InProcessIngest]:
    """A second ingest replica with the default policy: https only."""
    with another_ingest(system, "ingest-strict", HOOKLINE_ALLOW_HTTP="false") as ingest:
        yield ingest


def test_http_urls_are_refused_unless_allowed(strict_ingest: InProcessIngest) -> None:
    response = httpx.post(
        strict_ingest.base_url + "/v1/endpoints",
        headers={"authorization": f"Bearer {services.TOKEN}"},
        json={"tenant": "acme", "url": "http://example.com/hook", "event_types": ["#"]},
    )
    assert response.status_code == 422
    assert response.json()["details"] == [
        {"field": "url", "message": "only https URLs are allowed (HOOKLINE_ALLOW_HTTP is off)"}
    ]


async def test_the_operator_tenant_is_reserved(system: IngestSystem) -> None:
    with system.api() as api:
        event = await asyncio.to_thread(
            api.post, "/v1/events", json={"tenant": "hookline", "type": "hookline.notification", "data": {}}
        )
        endpoint = await asyncio.to_thread(
            api.post,
            "/v1/endpoints",
            json={"tenant": "hookline", "url": "http://127.0.0.1:9/x", "event_types": ["#"], "verify": False},
        )
    assert event.status_code == 422, event.text
    assert "reserved" in event.json()["message"]
    assert endpoint.status_code == 422, endpoint.text
    assert "reserved" in json.dumps(endpoint.json())


def test_a_replay_since_before_the_epoch_reads_the_whole_log(system: IngestSystem) -> None:
    """Found by the API fuzzer: a replay since year 511 was a 500 (no stream starts before 1970)."""
    owner = tenant()
    endpoint = system.add_endpoint(owner, "https://example.com/hook", ["order.*"])
    with system.api() as api:
        published = api.post("/v1/events", json={"tenant": owner, "type": "order.created", "data": {}})
        assert published.status_code == 202, published.text
        response = api.post(
            f"/v1/endpoints/{endpoint['id']}/replay", json={"since": "0511-04-06T08:39:56.0Z"}
        )
    assert response.status_code == 200, response.text
    assert response.json()["replayed"] == 1


def test_a_replay_window_that_ends_before_it_starts_names_the_field_given(system: IngestSystem) -> None:
    """Found by the API fuzzer: a ``since`` in the future without ``until`` was refused with no field
    named, and as a problem with ``until``, which the caller had not given."""
    endpoint = system.add_endpoint(tenant(), "https://example.com/hook", ["order.*"])
    replay = f"/v1/endpoints/{endpoint['id']}/replay"
    with system.api() as api:
        future = api.post(replay, json={"since": "3282-05-24T18:22:33.3-21:41"})
        reversed_window = api.post(
            replay, json={"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"}
        )
    assert future.status_code == 422, future.text
    assert future.json()["details"] == [
        {"field": "since", "message": "is in the future: nothing has been accepted after it yet"}
    ]
    assert reversed_window.status_code == 422, reversed_window.text
    assert reversed_window.json()["details"] == [{"field": "until", "message": "is before since"}]
