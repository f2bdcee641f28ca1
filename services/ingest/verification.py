"""The verification handshake: before an endpoint gets deliveries, it must answer a signed
``hookline.endpoint.verification`` POST with a 2xx within its timeout (as Convoy's ping, signed like
every delivery, so the receiver's verification code is exercised too)."""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime

from hookline.ingest.state import IngestState
from hookline.shared import signing
from hookline.shared.ids import new_id
from hookline.shared.models import Event, StoredEndpoint, Verification

VERIFICATION_TYPE = "hookline.endpoint.verification"


def signing_keys(state: IngestState, endpoint: StoredEndpoint, now: datetime) -> list[bytes]:
    return [
        signing.secret_key(state.sealer.open(secret.value))
        for secret in endpoint.secrets
        if secret.expires_at is None or secret.expires_at > now
    ]


async def verify(state: IngestState, endpoint: StoredEndpoint) -> Verification:
    now = datetime.now(UTC)
    event = Event(
        id=new_id("evt"),
        type=VERIFICATION_TYPE,
        tenant=endpoint.tenant,
        occurred_at=now,
        data={"endpoint_id": endpoint.id, "challenge": secrets.token_urlsafe(16)},
    )
    body = event.model_dump_json(exclude_none=True).encode()
    timestamp_s = int(time.time())
    headers = {
        "content-type": "application/json",
        "webhook-id": event.id,
        "webhook-timestamp": str(timestamp_s),
        "webhook-signature": signing.signature_header(
            signing_keys(state, endpoint, now), event.id, timestamp_s, body
        ),
    }
    result = await state.client.post(endpoint.url, body, headers, timeout_s=endpoint.timeout_s)
    ok = result.status is not None and 200 <= result.status < 300
    return Verification(
        ok=ok, at=datetime.now(UTC), status=result.status, error=None if ok else result.detail
    )
