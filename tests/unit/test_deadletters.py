"""Dead-letter records read back from the stream: ours, and the broker's delivery-limit ones."""

from __future__ import annotations

from datetime import UTC, datetime

from hookline.shared.deadletters import dead_letter_message, item_id, offset_of, read_item
from hookline.shared.models import DeadLetterReason

NOW = datetime(2026, 11, 29, 18, 0, tzinfo=UTC)
BODY = b'{"id": "evt_1", "type": "order.created", "tenant": "acme"}'


def test_our_dead_letters_round_trip() -> None:
    message = dead_letter_message(
        BODY, reason=DeadLetterReason.MAX_ATTEMPTS, endpoint_id="ep_1", tenant="acme", event_id="evt_1",
        attempts=7, last_status=503, last_error="HTTP 503: busy" + "x" * 1000, now=NOW,
    )  # fmt: skip
    item = read_item(12, message.body, message.headers, message_id=message.message_id, timestamp=None)
    assert item.model_dump() == {
        "id": "dl_12", "event_id": "evt_1", "endpoint_id": "ep_1", "tenant": "acme", "type": "order.created",
        "reason": DeadLetterReason.MAX_ATTEMPTS, "attempts": 7, "last_status": 503,
        "last_error": ("HTTP 503: busy" + "x" * 1000)[:500], "dead_at": NOW,
    }  # fmt: skip


def test_an_invalid_body_is_listed_without_type() -> None:
    message = dead_letter_message(
        b"\xff not json", reason=DeadLetterReason.INVALID_EVENT, endpoint_id="ep_1", tenant="acme",
        event_id=None, attempts=0, last_status=None, last_error="Invalid JSON", now=NOW,
    )  # fmt: skip
    item = read_item(3, message.body, message.headers, message_id=None, timestamp=None)
    assert (item.type, item.event_id, item.tenant, item.reason) == (
        None,
        None,
        "acme",
        DeadLetterReason.INVALID_EVENT,
    )


def test_a_broker_delivery_limit_dead_letter() -> None:
    headers = {
        "x-first-death-queue": "hookline.endpoint.ep_01ABC",
        "x-first-death-reason": "delivery_limit",
        "x-hookline-attempt": 3,
    }
    item = read_item(5, BODY, headers, message_id="evt_1", timestamp=NOW)
    assert (item.reason, item.endpoint_id, item.event_id, item.tenant, item.attempts, item.dead_at) == (
        DeadLetterReason.DELIVERY_LIMIT, "ep_01ABC", "evt_1", "acme", 3, NOW,
    )  # fmt: skip
    assert "delivery_limit" in item.last_error


def test_ids_are_offsets() -> None:
    assert item_id(42) == "dl_42"
    assert offset_of("dl_42") == 42
    assert offset_of("dl_x") is None
    assert offset_of("42") is None
