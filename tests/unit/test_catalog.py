"""The event-type catalog as a pure thing: records applied in order, events checked by their type's
schema (JSON pointers named), patterns matched against known types, the OpenAPI round trip."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from hookline.shared.contracts.models import EventTypeDeleted, EventTypeInfo, EventTypeUpserted
from hookline.shared.state import catalog

NOW = datetime(2026, 12, 1, tzinfo=UTC)
ORDER_SCHEMA = {
    "type": "object",
    "required": ["order_id", "total"],
    "properties": {
        "order_id": {"type": "string", "pattern": "^o_"},
        "total": {"type": "integer", "minimum": 0},
        "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}},
    },
    "$defs": {"line": {"type": "object", "required": ["sku"], "properties": {"sku": {"type": "string"}}}},
}


def described(name: str = "order.created", **fields: Any) -> EventTypeInfo:
    fields.setdefault("schemas", {"1": ORDER_SCHEMA})
    fields.setdefault("validation", "enforce")
    return EventTypeInfo(name=name, created_at=NOW, updated_at=NOW, **fields)


def upsert(event_type: EventTypeInfo, base: int | None = None) -> EventTypeUpserted:
    return EventTypeUpserted(change_id="c", at=NOW, event_type=event_type, base_version=base)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"order_id": "o_1", "total": 5}, None),
        ({"order_id": "o_1"}, [("/data", '"total" is a required property')]),
        ({"order_id": "x", "total": 5}, [("/data/order_id", None)]),
        ({"order_id": "o_1", "total": -1}, [("/data/total", None)]),
        ({"order_id": "o_1", "total": 1, "lines": [{"sku": "a"}, {}]}, [("/data/lines/1", None)]),
    ],
)
def test_an_event_is_checked_by_its_schema_and_the_place_is_named(
    data: dict[str, Any], expected: list[tuple[str, str | None]] | None
) -> None:
    types = catalog.Catalog()
    types.apply(upsert(described()))
    violation = types.check("order.created", 1, data)
    if expected is None:
        assert violation is None
        return
    assert violation is not None
    assert violation.validation == "enforce"
    assert [pointer for pointer, _ in violation.problems] == [pointer for pointer, _ in expected]
    for (_, message), (_, wanted) in zip(violation.problems, expected, strict=True):
        assert wanted is None or message == wanted


def test_what_is_not_checked() -> None:
    types = catalog.Catalog()
    types.apply(upsert(described("order.off", validation="off")))
    types.apply(upsert(described("order.bare", schemas={})))
    assert types.check("order.off", 1, {}) is None  # validation off
    assert types.check("order.bare", 1, {}) is None  # no schema
    assert types.check("order.unknown", 1, {}) is None  # not in the catalog


def test_a_schema_version_the_type_does_not_have_is_a_violation() -> None:
    types = catalog.Catalog()
    types.apply(upsert(described(validation="warn")))
    violation = types.check("order.created", 2, {"order_id": "o_1", "total": 1})
    assert violation is not None
    assert violation.validation == "warn"
    assert violation.problems[0][0] == "/schema_version"


def test_records_apply_in_order_with_versions_and_stale_writes_change_nothing() -> None:
    types = catalog.Catalog()
    first = types.apply(upsert(described(), base=0))
    assert isinstance(first, EventTypeInfo)
    assert first.version == 1
    stale = types.apply(upsert(described(description="late"), base=0))
    assert isinstance(stale, catalog.Stale)
    second = types.apply(upsert(described(schemas={"1": {"type": "object", "required": ["x"]}}), base=1))
    assert isinstance(second, EventTypeInfo)
    assert second.version == 2
    violation = types.check("order.created", 1, {"order_id": "o_1", "total": 1})
    assert violation is not None  # the new schema applies: compiled validators are not kept across versions
    types.apply(EventTypeDeleted(change_id="d", at=NOW, name="order.created"))
    assert types.get("order.created") is None


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "not-a-type"},
        {"$ref": "https://example.com/schemas/order.json"},
        {"properties": {"a": {"$ref": "file:///etc/passwd"}}},
    ],
)
def test_invalid_schemas_and_references_outside_the_schema_are_refused(schema: dict[str, Any]) -> None:
    with pytest.raises(catalog.SchemaError):
        catalog.compile_schema(schema)


def test_patterns_that_match_no_known_type() -> None:
    types = catalog.Catalog()
    assert types.unknown_patterns(["anything.*"]) == []  # an empty catalog is not in use
    types.apply(upsert(described("order.created")))
    types.apply(upsert(described("order.shipped.partially")))
    assert types.unknown_patterns(["order.*", "order.#", "ordr.*", "invoice.paid", "#"]) == [
        "ordr.*",
        "invoice.paid",
    ]


def test_the_openapi_export_imports_back_the_same_types() -> None:
    types = [
        described("order.created", description="An order was placed.\nWith lines.", examples=[{"order_id": "o_1", "total": 3}]),
        described("order.cancelled", schemas={"1": {"type": "object"}, "2": ORDER_SCHEMA}, deprecated=True, validation="warn"),
    ]  # fmt: skip
    document = catalog.to_openapi(types, title="t", version="1")
    assert document["openapi"].startswith("3.1")
    created = document["webhooks"]["order.created"]["post"]
    assert created["summary"] == "An order was placed."
    schema = created["requestBody"]["content"]["application/json"]["schema"]
    assert schema["properties"]["data"] == ORDER_SCHEMA
    assert schema["properties"]["type"] == {"const": "order.created"}
    back = {body["name"]: body for body in catalog.from_openapi(document)}
    for original in types:
        again = back[original.name]
        assert again["schemas"] == original.schemas
        assert again["examples"] == original.examples
        assert again["deprecated"] == original.deprecated
        assert again["validation"] == original.validation
        assert again["description"] == original.description


def test_a_foreign_openapi_document_gives_the_data_schema_of_each_webhook() -> None:
    document = {
        "openapi": "3.1.0",
        "info": {"title": "theirs", "version": "2"},
        "webhooks": {
            "invoice.paid": {
                "post": {
                    "summary": "An invoice was paid",
                    "requestBody": {"content": {"application/json": {"schema": {
                        "type": "object", "properties": {"data": {"type": "object", "required": ["invoice_id"]}},
                    }}}},
                }
            },
            "refund.created": {"post": {"requestBody": {"content": {"application/json": {"schema": {"type": "object"}}}}}},
        },
    }  # fmt: skip
    found = {body["name"]: body for body in catalog.from_openapi(document)}
    assert found["invoice.paid"]["schemas"] == {"1": {"type": "object", "required": ["invoice_id"]}}
    assert found["invoice.paid"]["description"] == "An invoice was paid"
    assert found["refund.created"]["schemas"] == {"1": {"type": "object"}}
    with pytest.raises(ValueError, match="no webhooks"):
        catalog.from_openapi({"openapi": "3.1.0", "paths": {}})
