"""The outbox relay's pure parts: a row as the event receivers get, and which rows of a claim may go."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from hookline.outbox_relay.rows import (
    OutboxRow,
    Ready,
    Refused,
    held_back,
    order_key,
    prepare,
    publish_order,
)
from hookline.shared.contracts.models import Event

CREATED = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)


def row(
    position: int, subject: str | None = "s1", sequence: int | None = None, **changes: object
) -> OutboxRow:
    fields: dict[str, object] = {
        "position": position, "id": f"evt_{position}", "tenant": "acme", "type": "order.created",
        "subject": subject, "sequence": sequence, "schema_version": 1, "data": '{"total": 4200}',
        "occurred_at": CREATED, "traceparent": None, "created_at": CREATED,
    }  # fmt: skip
    fields.update(changes)
    return OutboxRow(**fields)  # type: ignore[arg-type]


def test_a_row_becomes_the_event_as_published() -> None:
    local = datetime(2026, 12, 1, 12, 30, 0, 123456, tzinfo=timezone(timedelta(hours=2)))
    ready = prepare(row(7, sequence=3, occurred_at=local), max_bytes=10_000)
    assert isinstance(ready, Ready)
    body = json.loads(ready.body)
    assert body == {
        "id": "evt_7", "type": "order.created", "tenant": "acme", "occurred_at": "2026-12-01T10:30:00.123456Z",
        "subject": "s1", "sequence": 3, "schema_version": 1, "data": {"total": 4200},
    }  # fmt: skip
    assert ready.event == Event.model_validate(body)


def test_absent_fields_are_left_out_of_the_body() -> None:
    ready = prepare(row(1, subject=None), max_bytes=10_000)
    assert isinstance(ready, Ready)
    assert "subject" not in json.loads(ready.body)
    assert "sequence" not in json.loads(ready.body)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"data": json.dumps({"x": "y" * 500})}, "over HOOKLINE_MAX_PAYLOAD_BYTES (400)"),
        ({"id": "evt 1"}, "id:"),
        ({"tenant": "ACME"}, "tenant:"),
        ({"type": "Order"}, "type:"),
        ({"sequence": 1, "subject": None}, "sequence needs a subject"),
    ],
)
def test_a_row_that_makes_no_event_is_refused_saying_why(changes: dict[str, object], reason: str) -> None:
    refused = prepare(row(1, **changes), max_bytes=400)
    assert isinstance(refused, Refused)
    assert reason in refused.reason
    assert "yyyy" not in refused.reason  # never the payload


@pytest.mark.parametrize(
    ("claimed", "first_elsewhere", "going"),
    [
        pytest.param([row(1), row(2)], {}, [1, 2], id="nothing-elsewhere"),
        pytest.param([row(5), row(6)], {("acme", "s1"): order_key(None, 3)}, [], id="an-earlier-row-elsewhere"),
        pytest.param([row(2), row(6)], {("acme", "s1"): order_key(None, 4)}, [2], id="up-to-the-one-elsewhere"),
        pytest.param([row(5, subject=None)], {("acme", "s1"): order_key(None, 1)}, [5], id="no-subject"),
        pytest.param(
            [row(5, subject="s2"), row(6)], {("acme", "s1"): order_key(None, 1)}, [5], id="only-its-subject"
        ),
        pytest.param(
            [row(9, sequence=4), row(10, sequence=6)], {("acme", "s1"): order_key(5, 8)}, [9],
            id="numbered-by-sequence-not-position",
        ),
        pytest.param(
            [row(1, sequence=2)], {("acme", "s1"): order_key(None, 0)}, [1], id="numbered-before-unnumbered"
        ),
        pytest.param(
            [row(1, tenant="beta")], {("acme", "s1"): order_key(None, 0)}, [1], id="another-tenants-subject"
        ),
    ],
)  # fmt: skip
def test_a_row_waits_only_for_an_earlier_row_of_its_subject_held_elsewhere(
    claimed: list[OutboxRow], first_elsewhere: dict[tuple[str, str], tuple[bool, int, int]], going: list[int]
) -> None:
    may_go, waiting = held_back(claimed, first_elsewhere)
    assert [r.position for r in may_go] == going
    assert sorted(r.position for r in may_go + waiting) == sorted(r.position for r in claimed)


def test_each_subject_goes_in_its_order_in_the_places_its_rows_held() -> None:
    rows = [
        row(1, subject="a", sequence=2), row(2, subject=None), row(3, subject="b", sequence=1),
        row(4, subject="a", sequence=1), row(5, subject="b", sequence=0),
    ]  # fmt: skip
    ready = [prepare(r, max_bytes=10_000) for r in rows]
    assert all(isinstance(r, Ready) for r in ready)
    ordered = publish_order([r for r in ready if isinstance(r, Ready)])
    assert [r.row.position for r in ordered] == [4, 2, 5, 1, 3]
