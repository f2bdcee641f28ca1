"""What the dispatcher accepts from an endpoint queue, and the reason it gives for what it does not."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hookline.dispatcher.decoding import Inbound, Invalid, parse

EVENT = {
    "id": "evt_1",
    "type": "order.created",
    "tenant": "acme",
    "occurred_at": "2026-11-29T18:00:00Z",
    "data": {"order_id": "o_1"},
}


def _parse(body: bytes | None = None, **overrides: Any) -> Inbound | Invalid:
    arguments: dict[str, Any] = {
        "message_id": "evt_1",
        "content_type": "application/json",
        "exchange": "events",
        "routing_key": "acme.order.created",
        "headers": None,
        "endpoint_tenant": "acme",
        "max_bytes": 1024,
    }
    arguments.update(overrides)
    return parse(json.dumps(EVENT).encode() if body is None else body, **arguments)


def test_a_valid_event_is_attempt_one() -> None:
    parsed = _parse()
    assert isinstance(parsed, Inbound)
    assert parsed.event.id == "evt_1"
    assert parsed.attempt == 1
    assert parsed.first_attempt_at_s is None


def test_attempt_and_first_attempt_time_come_from_our_headers() -> None:
    parsed = _parse(
        exchange="hookline.delay.delivery",
        routing_key="anything",
        headers={"x-hookline-attempt": 3, "x-hookline-first-attempt-at": 1700000000},
    )
    assert isinstance(parsed, Inbound)
    assert (parsed.attempt, parsed.first_attempt_at_s) == (3, 1700000000.0)


def test_headers_on_an_upstream_publish_are_not_believed() -> None:
    """Only hookline publishes attempts, first-attempt times and sequences; on what arrives from
    ``events`` they are an upstream's claim, and ignored."""
    forged = {"x-hookline-attempt": 999, "x-hookline-first-attempt-at": 1, "x-hookline-seq": 5}
    parsed = _parse(exchange="events", headers=forged)
    assert isinstance(parsed, Inbound)
    assert (parsed.attempt, parsed.first_attempt_at_s, parsed.sequence) == (1, None, None)


@pytest.mark.parametrize("exchange", ["hookline.delay.delivery", ""])
def test_headers_on_what_hookline_published_are_used(exchange: str) -> None:
    ours = {"x-hookline-attempt": 4, "x-hookline-first-attempt-at": 1700000000, "x-hookline-seq": 5}
    parsed = _parse(exchange=exchange, headers=ours)
    assert isinstance(parsed, Inbound)
    assert (parsed.attempt, parsed.first_attempt_at_s, parsed.sequence) == (4, 1700000000.0, 5)


@pytest.mark.parametrize(
    ("body", "overrides", "reason_contains"),
    [
        (b"not json", {}, "Invalid JSON"),
        (b"[1, 2]", {}, "should be an object"),
        (b'{"id": "evt_1"}', {}, "type: Field required"),
        (json.dumps({**EVENT, "type": "Order Created"}).encode(), {}, "type: String should match pattern"),
        (json.dumps({**EVENT, "data": [1]}).encode(), {}, "data: Input should be an object"),
        (json.dumps({**EVENT, "occurred_at": "yesterday"}).encode(), {}, "occurred_at"),
        (json.dumps({**EVENT, "occurred_at": "2026-11-29T18:00:00"}).encode(), {}, "timezone"),
        (json.dumps({**EVENT, "extra": 1}).encode(), {}, "extra: Extra inputs are not permitted"),
        (json.dumps({**EVENT, "schema_version": 0}).encode(), {}, "schema_version"),
        (None, {"content_type": "text/plain"}, "content_type must be application/json"),
        (None, {"content_type": None}, "content_type must be application/json"),
        (None, {"message_id": None}, "message_id property is missing"),
        (None, {"message_id": "evt_2"}, "differs from the body's id"),
        (None, {"routing_key": "acme.order.deleted"}, "does not match the body's tenant and type"),
        (None, {"routing_key": "other.order.created"}, "does not match"),
        (None, {"endpoint_tenant": "other"}, "not the endpoint's tenant"),
        (b"x" * 2000, {}, "over the limit of 1024"),
        ('{"id": "\u00e9"}'.encode(), {}, "id: String should match pattern"),
        (b"\xff\xfe", {}, "Invalid JSON"),
    ],
)
def test_invalid_messages_say_why(
    body: bytes | None, overrides: dict[str, Any], reason_contains: str
) -> None:
    parsed = _parse(body, **overrides)
    assert isinstance(parsed, Invalid)
    assert reason_contains in parsed.reason


def test_content_type_parameters_are_accepted() -> None:
    assert isinstance(_parse(content_type="application/json; charset=utf-8"), Inbound)
