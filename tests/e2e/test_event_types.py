"""The event-type catalog as an upstream team and an operator use it: types with schemas, validation off,
warn or enforce (a 422 naming the JSON pointer over HTTP, an ``invalid_event`` dead letter naming it
over AMQP), deprecation, patterns that match no known type, and the OpenAPI 3.1 webhooks round trip."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from support import services
from support.amqp import publish_event
from support.receiver import Receiver
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

PAYMENT_SCHEMA = {
    "type": "object",
    "required": ["payment_id", "amount"],
    "properties": {"payment_id": {"type": "string"}, "amount": {"type": "integer", "minimum": 1}},
}


def client(system: System, token: str = services.TOKEN) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {token}"}, timeout=30
    )


def event(acme: str, event_type: str, event_id: str, data: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "id": event_id,
        "tenant": acme,
        "type": event_type,
        "occurred_at": "2026-12-01T00:00:00Z",
        "data": data,
        **fields,
    }


def arrived(receiver: Receiver, path: str) -> list[str]:
    return [json.loads(r.body)["id"] for r in receiver.requests if r.path == path]


async def test_validation_off_warn_and_enforce(system: System, receiver: Receiver) -> None:
    acme = tenant()
    async with client(system) as api:
        created = await api.post(
            "/v1/event-types",
            json={"name": "payment.captured", "description": "A payment was captured.", "schemas": {"1": PAYMENT_SCHEMA},
                  "examples": [{"payment_id": "p_1", "amount": 100}], "validation": "enforce"},
        )  # fmt: skip
        assert created.status_code == 201, created.text
        assert created.headers["etag"] == '"1"'
        again = await api.post("/v1/event-types", json={"name": "payment.captured"})
        assert again.status_code == 409, again.text
    system.add_endpoint(acme, receiver.url("/payments"), ["payment.*"])

    async with client(system) as api:
        good = await api.post(
            "/v1/events",
            json=event(acme, "payment.captured", f"evt_ok_{acme}", {"payment_id": "p", "amount": 5}),
        )
        bad = await api.post(
            "/v1/events",
            json=event(acme, "payment.captured", f"evt_bad_{acme}", {"payment_id": "p", "amount": 0}),
        )
        old = await api.post(
            "/v1/events", json=event(acme, "payment.captured", f"evt_v2_{acme}", {}, schema_version=2)
        )
    assert good.status_code == 202, good.text
    assert good.json()["warnings"] == []
    assert bad.status_code == 422, bad.text
    assert bad.json()["error"] == "invalid_event"
    assert [d["field"] for d in bad.json()["details"]] == ["/data/amount"]
    assert old.status_code == 422, old.text
    assert [d["field"] for d in old.json()["details"]] == ["/schema_version"]

    # warn (and deprecated): accepted, and the answer says what is wrong; the log names the place only.
    async with client(system) as api:
        changed = await api.patch(
            "/v1/event-types/payment.captured",
            json={"validation": "warn", "deprecated": True},
            headers={"if-match": '"1"'},
        )
        assert changed.status_code == 200, changed.text
        stale = await api.patch(
            "/v1/event-types/payment.captured", json={"validation": "off"}, headers={"if-match": '"1"'}
        )
        assert stale.status_code == 409, stale.text
        warned = await api.post(
            "/v1/events",
            json=event(acme, "payment.captured", f"evt_warned_{acme}", {"payment_id": "p", "amount": "lots"}),
        )
    assert warned.status_code == 202, warned.text
    warnings = warned.json()["warnings"]
    assert any("/data/amount" in w for w in warnings), warnings
    assert any("deprecated" in w for w in warnings), warnings
    assert "lots" not in system.ingest.log()

    await eventually(
        lambda: asyncio.sleep(
            0, {f"evt_ok_{acme}", f"evt_warned_{acme}"} <= set(arrived(receiver, "/payments"))
        )
    )
    assert f"evt_bad_{acme}" not in arrived(receiver, "/payments")


async def test_an_event_published_over_amqp_that_breaks_an_enforced_schema_is_dead_lettered_naming_the_place(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    async with client(system) as api:
        created = await api.post(
            "/v1/event-types",
            json={"name": "refund.issued", "schemas": {"1": PAYMENT_SCHEMA}, "validation": "enforce"},
        )
        assert created.status_code == 201, created.text
    endpoint = system.add_endpoint(acme, receiver.url("/refunds"), ["refund.*"])
    await publish_event(
        system.amqp_url,
        event(acme, "refund.issued", f"evt_amqp_bad_{acme}", {"payment_id": 7, "amount": 1}),
        f"{acme}.refund.issued",
    )
    await publish_event(
        system.amqp_url,
        event(acme, "refund.issued", f"evt_amqp_ok_{acme}", {"payment_id": "p", "amount": 1}),
        f"{acme}.refund.issued",
    )

    async def dead() -> list[dict[str, Any]] | None:
        async with client(system) as api:
            page = (await api.get("/v1/dead-letters", params={"endpoint_id": endpoint["id"]})).json()
        return page["data"] or None

    [letter] = await eventually(dead)
    assert letter["event_id"] == f"evt_amqp_bad_{acme}"
    assert letter["reason"] == "invalid_event"
    assert "/data/payment_id" in letter["last_error"]
    await eventually(lambda: asyncio.sleep(0, f"evt_amqp_ok_{acme}" in arrived(receiver, "/refunds")))
    assert f"evt_amqp_bad_{acme}" not in arrived(receiver, "/refunds")


async def test_only_the_admin_changes_the_catalog_and_unknown_patterns_are_warned_about(
    system: System, receiver: Receiver
) -> None:
    acme = tenant()
    async with client(system) as api:
        assert (await api.post("/v1/event-types", json={"name": "shipment.sent"})).status_code == 201
        bad_schema = await api.post(
            "/v1/event-types",
            json={"name": "shipment.lost", "schemas": {"1": {"$ref": "https://evil.example/s.json"}}},
        )
        assert bad_schema.status_code == 422, bad_schema.text
        assert bad_schema.json()["details"][0]["field"] == "schemas.1"
        made = await api.post(
            "/v1/endpoints",
            json={
                "tenant": acme,
                "url": receiver.url("/x"),
                "event_types": ["shipment.*", "shipmnet.*"],
                "verify": False,
            },
        )
        assert made.status_code == 201, made.text
        assert made.json()["warnings"] == [
            "event_types pattern 'shipmnet.*' matches no type in the event-type catalog"
        ]
        changed = await api.patch(f"/v1/endpoints/{made.json()['id']}", json={"event_types": ["shipping.*"]})
        assert changed.status_code == 200, changed.text
        assert "shipping.*" in changed.headers["hookline-warning"]


async def test_the_catalog_exports_and_imports_openapi_webhooks(system: System) -> None:
    async with client(system) as api:
        assert (
            await api.post(
                "/v1/event-types",
                json={
                    "name": "invoice.paid",
                    "description": "Paid.",
                    "schemas": {"1": PAYMENT_SCHEMA},
                    "validation": "warn",
                },
            )
        ).status_code == 201
        exported = (await api.get("/v1/openapi/webhooks")).json()
        assert exported["openapi"] == "3.1.0"
        webhook = exported["webhooks"]["invoice.paid"]["post"]
        assert (
            webhook["requestBody"]["content"]["application/json"]["schema"]["properties"]["data"]
            == PAYMENT_SCHEMA
        )
        # Imported elsewhere (here: back, with one type renamed and one added from a foreign document).
        exported["webhooks"]["invoice.voided"] = exported["webhooks"].pop("invoice.paid")
        exported["webhooks"]["credit.note"] = {
            "post": {
                "summary": "A credit note",
                "requestBody": {
                    "content": {
                        "application/json": {
                            "schema": {"type": "object", "properties": {"data": {"type": "object"}}}
                        }
                    }
                },
            }
        }
        imported = await api.post("/v1/openapi/webhooks", json=exported)
        assert imported.status_code == 200, imported.text
        assert "invoice.voided" in imported.json()["imported"]
        voided = (await api.get("/v1/event-types/invoice.voided")).json()
        assert voided["schemas"] == {"1": PAYMENT_SCHEMA}
        assert voided["validation"] == "warn"
        assert (await api.get("/v1/event-types/credit.note")).json()["schemas"] == {"1": {"type": "object"}}
        assert (await api.delete("/v1/event-types/credit.note")).status_code == 204
        assert (await api.get("/v1/event-types/credit.note")).status_code == 404
        broken = await api.post("/v1/openapi/webhooks", json={"openapi": "3.1.0", "paths": {}})
        assert broken.status_code == 422, broken.text
