"""Records the unit tests build again and again: a stored endpoint and an attempt record, valid by
default, with any field changed by keyword."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from hookline.shared.contracts.models import SigningSecret, StoredEndpoint
from hookline.shared.contracts.telemetry import AttemptRecord

CREATED = datetime(2026, 12, 1, tzinfo=UTC)
SECRET = "whsec_" + "A" * 44


def stored_endpoint(endpoint_id: str = "ep_" + "1" * 26, **changes: Any) -> StoredEndpoint:
    fields: dict[str, Any] = {
        "id": endpoint_id, "tenant": "acme", "url": "https://example.com/hook", "event_types": ["#"],
        "created_at": CREATED, "updated_at": CREATED, "secrets": [SigningSecret(value=SECRET, created_at=CREATED)],
        "routed": True, "laned": True,
    }  # fmt: skip
    fields.update(changes)
    return StoredEndpoint(**fields)


def attempt_record(at_s: float, **changes: Any) -> AttemptRecord:
    """A successful first delivery attempt that ended at ``at_s``."""
    fields: dict[str, Any] = {
        "at_s": at_s, "dispatcher_id": "d", "event_id": "e", "endpoint_id": "ep", "tenant": "t", "type": "a.b",
        "attempt": 1, "outcome": "success", "status": 204, "error": None, "duration_ms": 10.0,
        "first_attempt_at_s": at_s,
    }  # fmt: skip
    fields.update(changes)
    return AttemptRecord(**fields)
