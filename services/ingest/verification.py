"""The verification handshake: before an endpoint gets deliveries, it must answer a signed
``hookline.endpoint.verification`` POST with a 2xx within its timeout (as Convoy's ping, signed like
every delivery, so the receiver's verification code is exercised too)."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

from hookline.ingest.attempts import Attempts
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import Event, StoredEndpoint, Verification

VERIFICATION_TYPE = "hookline.endpoint.verification"


async def verify(attempts: Attempts, endpoint: StoredEndpoint) -> Verification:
    now = datetime.now(UTC)
    event = Event(
        id=new_id("evt"),
        type=VERIFICATION_TYPE,
        tenant=endpoint.tenant,
        occurred_at=now,
        data={"endpoint_id": endpoint.id, "challenge": secrets.token_urlsafe(16)},
    )
    body = event.model_dump_json(exclude_none=True).encode()
    result, _ = await attempts.make(
        endpoint,
        event_id=event.id,
        event_type=VERIFICATION_TYPE,
        body=body,
        kind="verification",
        number=1,
    )
    ok = result.status is not None and 200 <= result.status < 300
    return Verification(
        ok=ok, at=datetime.now(UTC), status=result.status, error=None if ok else result.detail
    )
