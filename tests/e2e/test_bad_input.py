"""Bad input gets a clear answer naming the problem, and nothing published is ever dropped silently."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import services
from support.amqp import event, publish_event, read_stream
from support.receiver import Receiver
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e


def test_every_api_route_needs_the_token(system: System) -> None:
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
    system: System, body: bytes, status: int, error: str, fields: set[str] | None
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


def test_bad_endpoints_are_refused_naming_the_field(system: System) -> None:
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
def strict_ingest(system: System, tmp_path: Path) -> Iterator[services.Service]:
    """A second ingest replica with the default policy: https only."""
    env = {**system.env, "HOOKLINE_ALLOW_HTTP": "false"}
    ingest = services.start("ingest", env, tmp_path, name="ingest-strict")
    try:
        ingest.wait_ready()
        yield ingest
    finally:
        assert ingest.stop() == 0


def test_http_urls_are_refused_unless_allowed(strict_ingest: services.Service) -> None:
    response = httpx.post(
        strict_ingest.base_url + "/v1/endpoints",
        headers={"authorization": f"Bearer {services.TOKEN}"},
        json={"tenant": "acme", "url": "http://example.com/hook", "event_types": ["#"]},
    )
    assert response.status_code == 422
    assert response.json()["details"] == [
        {"field": "url", "message": "only https URLs are allowed (HOOKLINE_ALLOW_HTTP is off)"}
    ]


GARBAGE = [
    ("not-json", b"this is not json", {}),
    (
        "wrong-type",
        json.dumps({"id": "evt_g2", "type": 5, "tenant": "T", "occurred_at": "x", "data": 1}).encode(),
        {},
    ),
    ("no-message-id", None, {"message_id": None}),
    ("wrong-content-type", None, {"content_type": "text/plain"}),
    ("huge", b'{"blob": "' + b"x" * 400_000 + b'"}', {}),
    ("unicode", '{"id": "evt_\u202e\U0001f4a5", "type": "order.created"}'.encode(), {}),
]


async def test_garbage_published_to_amqp_is_dead_lettered_with_the_reason(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    endpoint = system.add_endpoint(acme, receiver.url("/garbage"), ["order.*"])
    for label, body, properties in GARBAGE:
        valid = event(acme, "order.created", f"evt_{label}")
        payload = json.dumps(valid).encode() if body is None else body
        props = {"message_id": f"evt_{label}", **properties}
        await publish_event(system.amqp_url, payload, f"{acme}.order.created", **props)
    # The dispatchers keep running: a valid event published afterwards is delivered.
    await publish_event(
        system.amqp_url, event(acme, "order.created", "evt_after_garbage"), f"{acme}.order.created"
    )
    delivered = await receiver.wait_for(1, path="/garbage")
    assert [r.headers["webhook-id"] for r in delivered] == ["evt_after_garbage"]

    dead = await read_stream(system.amqp_url, "hookline.dead-letters", at_least=len(GARBAGE))
    mine = [m for m in dead if (m.headers or {}).get("x-hookline-endpoint-id") == endpoint["id"]]
    assert len(mine) == len(GARBAGE)
    reasons = {m.message_id: m.headers for m in mine}
    assert all(headers["x-hookline-reason"] == "invalid_event" for headers in reasons.values())
    by_error = sorted(str(headers["x-hookline-last-error"]) for headers in reasons.values())
    for expected in (
        "Invalid JSON",
        "type: Input should be a valid string",
        "differs from the body's id",  # aio-pika fills in a random message_id; unit tests cover None
        "content_type must be application/json",
        "over the limit",
        "id: String should match pattern",
    ):
        assert any(expected in error for error in by_error), (expected, by_error)
    # The original bytes are kept for inspection.
    assert any(m.body == b"this is not json" for m in mine)

    def invalid_lines() -> list[dict[str, object]]:
        return [
            line
            for line in (json.loads(raw) for raw in system.logs().splitlines() if raw.startswith("{"))
            if line.get("event") == "event_invalid" and line.get("endpoint_id") == endpoint["id"]
        ]

    # Logged as each is dead-lettered: all there once the dead letters are.
    await eventually(lambda: asyncio.to_thread(lambda: len(invalid_lines()) >= len(GARBAGE)))
    assert len(invalid_lines()) == len(GARBAGE), "each invalid message is logged once"
