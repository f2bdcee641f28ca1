"""The event and endpoint contracts of DESIGN.md, as tables of accepted and refused values."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from hookline.ingest.schemas import EndpointCreate, EndpointUpdate, EventIn
from hookline.shared.contracts.models import Event

BASE = {
    "id": "evt_1",
    "type": "order.created",
    "tenant": "acme",
    "occurred_at": "2026-11-29T18:00:00Z",
    "data": {},
}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("id", "evt_01JD.x:y-z_"),
        ("id", "a" * 128),
        ("type", "order"),
        ("type", "order.created.v2_beta"),
        ("tenant", "acme-eu_1"),
        ("tenant", "a" * 64),
        ("subject", "order_123"),
        ("sequence", 0),
        ("sequence", 2**63 - 1),
        ("schema_version", 3),
        ("data", {"nested": {"list": [1, None, "x"]}}),
        ("occurred_at", "2026-11-29T19:00:00+01:00"),
    ],
)
def test_event_accepts(field: str, value: Any) -> None:
    subject = {} if field == "subject" else {"subject": "order_1"}  # a sequence counts a subject's events
    assert getattr(Event.model_validate({**BASE, **subject, field: value}), field) is not None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("id", ""),
        ("id", "a" * 129),
        ("id", "evt 1"),
        ("id", "evt/1"),
        ("type", ""),
        ("type", "Order.created"),
        ("type", "order..created"),
        ("type", "order.*"),
        ("type", "a" * 191),
        ("tenant", ""),
        ("tenant", "acme.eu"),
        ("tenant", "ACME"),
        ("tenant", "a" * 65),
        ("subject", ""),
        ("schema_version", 0),
        ("data", "string"),
        ("data", None),
        ("occurred_at", "2026-11-29T18:00:00"),
        ("occurred_at", "not a time"),
        ("sequence", -1),
        ("sequence", 2**63),
        ("sequence", "5"),
        ("sequence", 1.5),
        ("sequence", True),
    ],
)
def test_event_refuses(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as caught:
        Event.model_validate({**BASE, "subject": "order_1", field: value})
    assert caught.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("model", [Event, EventIn])
def test_a_sequence_needs_a_subject(model: type[Event] | type[EventIn]) -> None:
    with pytest.raises(ValidationError, match="sequence needs a subject"):
        model.model_validate({**BASE, "sequence": 1})


def test_the_sequence_goes_through_the_api_model_and_out_in_the_body() -> None:
    event = EventIn.model_validate({**BASE, "subject": "order_1", "sequence": 7}).complete(
        event_id="evt_x", now=datetime.now(UTC)
    )
    assert (event.sequence, orjson.loads(event.model_dump_json())["sequence"]) == (7, 7)
    assert "sequence" not in orjson.loads(Event.model_validate(BASE).model_dump_json(exclude_none=True))


def test_event_in_fills_id_and_time_only_when_absent() -> None:
    now = datetime(2026, 11, 29, 18, 0, tzinfo=UTC)
    filled = EventIn(type="a.b", tenant="t", data={}).complete(event_id="evt_new", now=now)
    assert (filled.id, filled.occurred_at, filled.schema_version) == ("evt_new", now, 1)
    kept = EventIn.model_validate(BASE).complete(event_id="evt_new", now=now)
    assert kept.id == "evt_1"
    assert kept.occurred_at == datetime(2026, 11, 29, 18, 0, tzinfo=UTC)


ENDPOINT = {"tenant": "acme", "url": "https://example.com/hook", "event_types": ["order.*"]}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("url", "ftp://example.com/"),
        ("url", "example.com/hook"),
        ("url", "https:///nohost"),
        ("url", "https://example.com/#frag"),
        ("url", "https://example.com/" + "a" * 2048),
        ("event_types", []),
        ("event_types", ["Order.*"]),
        ("event_types", ["order.**"]),
        ("event_types", ["order."]),
        ("timeout_s", 0.5),
        ("timeout_s", 31),
        ("max_in_flight", 0),
        ("rate_limit_per_s", 0),
        ("tenant", "a.b"),
        ("unknown", 1),
    ],
)
def test_endpoint_create_refuses(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as caught:
        EndpointCreate.model_validate({**ENDPOINT, field: value})
    assert caught.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize(
    "patterns", [["order.created"], ["order.*"], ["#"], ["order.#", "*.created"], ["a.*.c"]]
)
def test_endpoint_create_accepts_topic_patterns(patterns: list[str]) -> None:
    assert EndpointCreate.model_validate({**ENDPOINT, "event_types": patterns}).event_types == patterns


POLLING = {"tenant": "acme", "kind": "polling", "event_types": ["order.*"]}


@pytest.mark.parametrize(
    ("given", "refused"),
    [
        ({**POLLING, "kind": "push"}, "a push endpoint needs one"),
        ({**POLLING, "url": "https://example.com/hook"}, "takes no url"),
        ({**POLLING, "ordered": True}, "takes no ordered"),
        ({**POLLING, "rate_limit_per_s": 5, "max_in_flight": 2}, "takes no max_in_flight, rate_limit_per_s"),
        ({**POLLING, "body_format": "slack"}, "takes no body_format"),
        ({**POLLING, "headers": {"x-a": "b"}}, "takes no headers"),
    ],
)
def test_an_endpoint_is_shaped_for_its_kind(given: dict[str, Any], refused: str) -> None:
    with pytest.raises(ValidationError, match=refused):
        EndpointCreate.model_validate(given)


@pytest.mark.parametrize(
    "given",
    [
        POLLING,
        {**POLLING, "ordered": False, "verify": True, "retention_s": 3600, "description": "our batch job"},
        {**POLLING, "notify_url": "https://example.com/ops"},
        ENDPOINT,
    ],
)
def test_what_an_endpoint_of_each_kind_accepts(given: dict[str, Any]) -> None:
    assert EndpointCreate.model_validate(given).kind == given.get("kind", "push")


def test_endpoint_update_cannot_change_the_tenant() -> None:
    for field, value in (("tenant", "other"), ("id", "ep_" + "1" * 26), ("version", 3)):
        with pytest.raises(ValidationError):
            EndpointUpdate.model_validate({field: value})


def test_error_summaries_name_the_field_and_never_show_the_input() -> None:
    from hookline.shared.contracts.models import error_summary

    secret_value = "whsec_" + "S" * 44
    with pytest.raises(ValidationError) as caught:
        EndpointCreate.model_validate(
            {**ENDPOINT, "url": "ftp://x", "description": secret_value, "extra": secret_value}
        )
    summary = error_summary(caught.value)
    assert "url:" in summary
    assert secret_value not in summary
