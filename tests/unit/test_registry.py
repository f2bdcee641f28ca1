"""The registry is the change log applied in order: upserts, deletes, listeners and read-back waits."""

from __future__ import annotations

from datetime import UTC, datetime

from hookline.shared.models import (
    EndpointDeleted,
    EndpointUpserted,
    SigningSecret,
    StoredEndpoint,
)
from hookline.shared.registry import EndpointRegistry

NOW = datetime(2026, 11, 29, tzinfo=UTC)


def _endpoint(endpoint_id: str, url: str = "https://example.com/") -> StoredEndpoint:
    return StoredEndpoint(
        id=endpoint_id,
        tenant="acme",
        url=url,
        event_types=["#"],
        created_at=NOW,
        updated_at=NOW,
        secrets=[SigningSecret(value="whsec_" + "A" * 44, created_at=NOW)],
    )


EP1 = "ep_" + "1" * 26
EP2 = "ep_" + "2" * 26


def test_upsert_replace_and_delete_notify_listeners_with_before_and_after() -> None:
    registry = EndpointRegistry()
    changes: list[tuple[str | None, str | None]] = []
    registry.subscribe(lambda before, after: changes.append((before and before.url, after and after.url)))

    registry.apply(EndpointUpserted(change_id="c1", at=NOW, endpoint=_endpoint(EP1, "https://a/")))
    registry.apply(EndpointUpserted(change_id="c2", at=NOW, endpoint=_endpoint(EP1, "https://b/")))
    registry.apply(EndpointUpserted(change_id="c3", at=NOW, endpoint=_endpoint(EP2)))
    registry.apply(EndpointDeleted(change_id="c4", at=NOW, endpoint_id=EP1))
    registry.apply(EndpointDeleted(change_id="c5", at=NOW, endpoint_id=EP1))  # already gone: no-op

    assert changes == [
        (None, "https://a/"),
        ("https://a/", "https://b/"),
        (None, "https://example.com/"),
        ("https://b/", None),
    ]
    assert [endpoint.id for endpoint in registry.all()] == [EP2]
    assert registry.get(EP1) is None
