"""An event as an AMQP message on ``events``: what the ingest API, the outbox relay and the health
monitor publish, and what an upstream publishing straight to RabbitMQ should send (DESIGN.md, "The
event")."""

from __future__ import annotations

from datetime import datetime

import aio_pika
from aio_pika.abc import FieldValue

from hookline.shared.contracts.headers import Header
from hookline.shared.contracts.models import Event
from hookline.shared.runtime.tracing import TraceContext


def event_message(
    event: Event,
    body: bytes,
    *,
    accepted_at: datetime,
    request_digest: str | None = None,
    trace: TraceContext | None = None,
) -> aio_pika.Message:
    """``body`` is ``event`` as JSON (the caller has it already, and checked its size)."""
    headers: dict[str, FieldValue] = {Header.ACCEPTED_AT_MS: int(accepted_at.timestamp() * 1000)}
    if request_digest is not None:
        headers[Header.REQUEST_DIGEST] = request_digest
    if trace is not None:
        headers.update(trace.headers())
    return aio_pika.Message(
        body,
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=event.id,
        # The AMQP timestamp has whole seconds; replay windows need better (the header).
        timestamp=accepted_at,
        headers=headers,
    )
