"""``POST /v1/events``: validate an event, give it an id, and answer 202 once the broker has confirmed it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

import aio_pika
import structlog
from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from hookline.ingest.auth import Caller
from hookline.ingest.state import IngestState, ingest_state
from hookline.shared import topology
from hookline.shared.amqp import BROKER_ERRORS, BrokerBlockedError
from hookline.shared.api import ApiError, broker_unavailable, invalid_input
from hookline.shared.headers import Header
from hookline.shared.ids import new_id
from hookline.shared.models import Event, EventAccepted, EventIn
from hookline.shared.notifications import OPERATOR_TENANT

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/v1/events", tags=["events"])

PUBLISH_TIMEOUT_S = 10.0


def event_message(event: Event, body: bytes, *, accepted_at: datetime) -> aio_pika.Message:
    """The AMQP message an upstream should publish for ``event``: the same one the API publishes."""
    return aio_pika.Message(
        body,
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=event.id,
        timestamp=accepted_at,
        # The AMQP timestamp has whole seconds; replay windows need better.
        headers={Header.ACCEPTED_AT_MS: int(accepted_at.timestamp() * 1000)},
    )


@router.post(
    "",
    status_code=202,
    response_model=EventAccepted,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": EventIn.model_json_schema()}},
        }
    },
)
async def publish_event(
    request: Request, state: Annotated[IngestState, Depends(ingest_state)], caller: Caller
) -> EventAccepted:
    # Read the body ourselves: the size limit applies while streaming, and malformed JSON is a 400.
    raw = await request.body()
    try:
        event_in = EventIn.model_validate_json(raw)
    except ValidationError as exc:
        raise invalid_input(exc.errors()) from None
    caller.require(event_in.tenant)
    if event_in.tenant == OPERATOR_TENANT:
        raise ApiError(
            422, "invalid_fields", f"tenant {OPERATOR_TENANT!r} is reserved for hookline's own notifications"
        )
    now = datetime.now(UTC)
    event = event_in.complete(event_id=new_id("evt"), now=now)
    body = event.model_dump_json(exclude_none=True).encode()
    if len(body) > state.settings.max_payload_bytes:
        raise ApiError(
            413, "payload_too_large", "the event exceeds HOOKLINE_MAX_PAYLOAD_BYTES once completed"
        )
    try:
        await state.publisher.publish(
            event_message(event, body, accepted_at=now),
            exchange=topology.EVENTS_EXCHANGE,
            routing_key=topology.event_routing_key(event.tenant, event.type),
            timeout_s=PUBLISH_TIMEOUT_S,
        )
    except BROKER_ERRORS as exc:
        log.warning("event_publish_failed", event_id=event.id, tenant=event.tenant, error=type(exc).__name__)
        why = (
            "the broker refuses publishes for now (a memory or disk alarm)"
            if isinstance(exc, BrokerBlockedError)
            else "the broker did not confirm it"
        )
        raise broker_unavailable(f"the event was not accepted: {why}; send it again") from None
    return EventAccepted(id=event.id, tenant=event.tenant, type=event.type)
