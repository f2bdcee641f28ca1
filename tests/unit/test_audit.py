"""What the audit trail keeps of a change (pure): the fields that changed, never a secret."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from hookline.ingest.audit import changes_between, redact_url
from hookline.shared.contracts.models import SigningSecret, StoredEndpoint

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def endpoint(**fields: object) -> StoredEndpoint:
    defaults: dict[str, object] = {
        "id": "ep_01JD0000000000000000000000",
        "tenant": "acme",
        "url": "https://hooks.example/a",
        "event_types": ["#"],
        "created_at": NOW,
        "updated_at": NOW,
        "secrets": [SigningSecret(value="whsec_" + "A" * 32, created_at=NOW)],
    }
    return StoredEndpoint.model_validate({**defaults, **fields})


@pytest.mark.parametrize(
    ("url", "kept"),
    [
        ("https://hooks.example/a/b", "https://hooks.example/a/b"),
        (
            "https://user:pw@hooks.example:8443/a?token=s3cret&x=1",
            "https://…@hooks.example:8443/a?token=…&x=…",
        ),
        ("https://hooks.slack.com/services/T0/B0/XYZ", "https://hooks.slack.com/services/T0/B0/XYZ"),
    ],
)
def test_urls_are_kept_without_credentials_or_query_values(url: str, kept: str) -> None:
    assert redact_url(url) == kept


def test_only_what_changed_and_secrets_only_as_changed() -> None:
    before = endpoint()
    after = endpoint(
        url="https://hooks.example/b?key=k",
        description="renamed",
        version=7,
        updated_at=datetime(2026, 12, 2, tzinfo=UTC),
        secrets=[SigningSecret(value="whsec_" + "B" * 32, created_at=NOW)],
        sealed_headers={"x-api-key": "v"},
    )
    assert changes_between(before, after) == {
        "description": {"from": "", "to": "renamed"},
        "url": {"from": "https://hooks.example/a", "to": "https://hooks.example/b?key=…"},
        "secrets": "changed",
        "sealed_headers": "changed",
    }
    assert "whsec_" not in str(changes_between(None, after))
