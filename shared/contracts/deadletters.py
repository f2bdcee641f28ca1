"""Dead letters: an event that will not be delivered, kept with why, in the stream ``hookline.dead-letters``.

The body is the original event, byte for byte (it may be the invalid bytes an upstream published); the
facts travel in ``x-hookline-*`` headers. A stream rather than a queue, so that dead letters can be
listed any number of times without consuming them. This module is the record's format (the dispatcher
writes it, the ingest writes a redrive's); :mod:`hookline.shared.state.deadletterindex` is the view of
the stream that lists and analyses them.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import aio_pika
import orjson
from pydantic import Field

from hookline.shared.broker.topology import delay_destination, endpoint_of
from hookline.shared.contracts.headers import Header
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import DeadLetterReason, Model

MAX_ERROR_CHARS = 500
#: The delay queues a retry waits in (``hookline.delay.NN``, see :func:`~hookline.shared.broker.topology.delay_level`).
DELAY_QUEUE_PREFIX = "hookline.delay."


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


#: A record in the dead-letter stream saying that these dead letters were redriven (body: {"ids": [...]}).
REDRIVEN_HEADER = "x-hookline-redriven"


class DeadLetterItem(Model):
    """A dead letter as the API lists it."""

    id: str = Field(description="dl_<stream offset>; stable, used to redrive one dead letter")
    event_id: str | None
    endpoint_id: str | None
    tenant: str | None
    type: str | None
    reason: DeadLetterReason
    attempts: int
    last_status: int | None
    last_error: str
    dead_at: datetime


def item_id(offset: int) -> str:
    return f"dl_{offset}"


def offset_of(dead_letter_id: str) -> int | None:
    number = dead_letter_id.removeprefix("dl_")
    return int(number) if number.isdigit() and dead_letter_id.startswith("dl_") else None


def read_item(
    offset: int,
    body: bytes,
    headers: Mapping[str, Any],
    *,
    message_id: str | None,
    timestamp: datetime | None,
    routing_key: str | None = None,
) -> DeadLetterItem:
    """A dead letter from its stream message: ours carry ``x-hookline-*`` headers; the broker's own
    (a message over the endpoint queue's delivery limit) carry ``x-death`` instead."""
    event_type, body_tenant = _peek(body)
    if Header.REASON in headers:
        return DeadLetterItem(
            id=item_id(offset),
            event_id=_text(headers.get(Header.EVENT_ID)),
            endpoint_id=_text(headers.get(Header.ENDPOINT_ID)),
            tenant=_text(headers.get(Header.TENANT)) or body_tenant,
            type=event_type,
            reason=DeadLetterReason(_text(headers[Header.REASON]) or "unknown"),
            attempts=_int(headers.get(Header.ATTEMPTS)) or 0,
            last_status=_int(headers.get(Header.LAST_STATUS)),
            last_error=_text(headers.get(Header.LAST_ERROR)) or "",
            dead_at=_when(headers.get(Header.DEAD_AT)) or timestamp or datetime.now(UTC),
        )
    deaths = headers.get("x-death")
    death = deaths[0] if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping) else {}
    # RabbitMQ 3.10 leaves x-death out for delivery-limit dead letters; x-first-death-* are always set.
    queue = _text(death.get("queue")) or _text(headers.get("x-first-death-queue")) or ""
    broker_reason = _text(death.get("reason")) or _text(headers.get("x-first-death-reason")) or "unknown"
    endpoint_id = endpoint_of(queue)
    if endpoint_id is None and routing_key and queue.startswith(DELAY_QUEUE_PREFIX):
        # A retry over the limit: its first death was its delay's expiry, and the routing key it came
        # back to the endpoint queue with names its destination.
        endpoint_id = endpoint_of(delay_destination(routing_key))
        broker_reason, queue = "delivery_limit", f"the queue of {endpoint_id}"
    return DeadLetterItem(
        id=item_id(offset),
        event_id=message_id,
        endpoint_id=endpoint_id,
        tenant=body_tenant,
        type=event_type,
        reason=DeadLetterReason.DELIVERY_LIMIT,
        attempts=_int(headers.get(Header.ATTEMPT)) or 0,
        last_status=None,
        last_error=f"dead-lettered by the broker ({broker_reason}) from {queue or 'an unknown queue'}",
        dead_at=_when(death.get("time")) or timestamp or datetime.now(UTC),
    )


def _peek(body: bytes) -> tuple[str | None, str | None]:
    """The event's type and tenant when the body is an event, for listing; None otherwise."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(data, dict):
        return None, None
    event_type, tenant = data.get("type"), data.get("tenant")
    return (event_type if isinstance(event_type, str) else None, tenant if isinstance(tenant, str) else None)


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _when(value: object) -> datetime | None:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    text = _text(value)
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


class DeadLetterAnalysis(Model):
    endpoint_id: str | None
    tenant: str | None
    count: int
    most_common_reason: DeadLetterReason
    most_common_error: str
    most_common_status: int | None
    first_at: datetime
    last_at: datetime
    mean_attempts: float
