"""The event-type catalog as an operator manages it over the API (the ingest in-process, on the real
broker): only the admin changes it, bad schemas are refused, patterns that match no known type are
warned about, and the OpenAPI 3.1 webhooks round trip. Validation on the delivery path (warn, enforce,
an ``invalid_event`` dead letter over AMQP) is tests/e2e/test_delivery_path.py."""

from __future__ import annotations

import httpx
import pytest
from support import services
from support.inprocess import IngestSystem
from support.receiver import Receiver
from support.system import tenant

pytestmark = pytest.mark.integration

PAYMENT_SCHEMA = {
    "type": "object",
    "required": ["payment_id", "amount"],
    "properties": {"payment_id": {"type": "string"}, "amount": {"type": "integer", "minimum": 1}},
}


def client(system: IngestSystem, token: str = services.TOKEN) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {token}"}, timeout=30
    )


async def test_only_the_admin_changes_the_catalog_and_unknown_patterns_are_warned_about(
    system: IngestSystem, receiver: Receiver
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


async def test_the_catalog_exports_and_imports_openapi_webhooks(system: IngestSystem) -> None:
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
