"""Dead letters: an event that will not be delivered, kept with why, in the stream ``hookline.dead-letters``.

The body is the original event, byte for byte (it may be the invalid bytes an upstream published); the
facts travel in ``x-hookline-*`` headers. A stream rather than a queue, so that dead letters can be
listed any number of times without consuming them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import aio_pika
from hookline.shared.headers import Header
from hookline.shared.ids import new_id
from hookline.shared.models import DeadLetterReason

MAX_ERROR_CHARS = 500


def dead_letter_message(
    body: bytes,
    *,
    reason: DeadLetterReason,
    endpoint_id: str,
    tenant: str | None,
    event_id: str | None,
    attempts: int,
    last_status: int | None,
    last_error: str,
    now: datetime,
    content_type: str | None = "application/json",
) -> aio_pika.Message:
    headers: dict[str, Any] = {
        Header.REASON: reason.value,
        Header.ENDPOINT_ID: endpoint_id,
        Header.ATTEMPTS: attempts,
        Header.LAST_ERROR: last_error[:MAX_ERROR_CHARS],
        Header.DEAD_AT: now.isoformat(),
    }
    if tenant is not None:
        headers[Header.TENANT] = tenant
    if event_id is not None:
        headers[Header.EVENT_ID] = event_id
    if last_status is not None:
        headers[Header.LAST_STATUS] = last_status
    return aio_pika.Message(
        body,
        headers=headers,
        content_type=content_type,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        # Unique per publish: aiormq matches returns to publishes by message_id.
        message_id=new_id("dl"),
        timestamp=now,
    )
