"""Which logged events a replay resends: the endpoint's tenant, matching types, inside the window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from hookline.ingest.replay import selects
from hookline.shared.contracts.models import SigningSecret, StoredEndpoint

T0 = datetime(2026, 11, 29, 18, 0, tzinfo=UTC)
ENDPOINT = StoredEndpoint(
    id="ep_" + "0" * 26, tenant="acme", url="https://example.com/", event_types=["order.*", "invoice.paid"],
    created_at=T0, updated_at=T0, secrets=[SigningSecret(value="whsec_" + "A" * 44, created_at=T0)],
)  # fmt: skip


@pytest.mark.parametrize(
    ("event", "accepted_at", "expected"),
    [
        ({"id": "e", "tenant": "acme", "type": "order.created"}, T0, True),
        ({"id": "e", "tenant": "acme", "type": "invoice.paid"}, T0 + timedelta(minutes=5), True),
        ({"id": "e", "tenant": "acme", "type": "invoice.void"}, T0, False),
        ({"id": "e", "tenant": "other", "type": "order.created"}, T0, False),
        ({"id": "e", "tenant": "acme", "type": "order.created"}, T0 - timedelta(seconds=1), False),
        ({"id": "e", "tenant": "acme", "type": "order.created"}, T0 + timedelta(minutes=11), False),
        ({"id": "e", "tenant": "acme", "type": "order.created"}, None, False),
        ({"tenant": "acme", "type": "order.created"}, T0, False),
        ([1, 2], T0, False),
    ],
)
def test_selects(event: Any, accepted_at: datetime | None, expected: bool) -> None:
    assert selects(ENDPOINT, event, accepted_at, T0, T0 + timedelta(minutes=10)) is expected


@pytest.mark.parametrize(
    ("data", "expected"),
    [({"amount": 1500}, True), ({"amount": 10}, False), ({}, False)],  # a missing field: no match
)
def test_a_replay_applies_the_endpoints_filter_as_it_is_now(data: dict[str, Any], expected: bool) -> None:
    filtered = ENDPOINT.model_copy(update={"filter": "data.amount >= 1000"})
    event = {"id": "e", "tenant": "acme", "type": "order.created", "data": data}
    assert selects(filtered, event, T0, T0, T0 + timedelta(minutes=10)) is expected
