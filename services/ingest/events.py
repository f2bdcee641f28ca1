"""``POST /v1/events``: validate an event, give it an id, and answer 202 once the broker has confirmed it
(200 ``duplicate`` when it was accepted before: see duplicates.py)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Header, Request, Response
from opentelemetry.trace import SpanKind
from pydantic import ValidationError

from hookline.ingest.auth import Caller
from hookline.ingest.deliverylog import Acceptance
from hookline.ingest.duplicates import IDEMPOTENCY_KEY_MAX, event_id_for_key, request_digest
from hookline.ingest.schemas import BatchAccepted, BatchIn, BatchItem, EventAccepted, EventIn
from hookline.ingest.state import IngestState, State
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import BROKER_ERRORS, BrokerBlockedError, Publisher
from hookline.shared.contracts.envelope import event_message
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import ErrorDetail, Event, EventFields
from hookline.shared.runtime import tracing
from hookline.shared.runtime.api import ApiError, broker_unavailable, invalid_input
from hookline.shared.runtime.tracing import TraceContext
from hookline.shared.state.catalog import Catalog
from hookline.shared.state.notifications import OPERATOR_TENANT

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/v1/events", tags=["events"])

PUBLISH_TIMEOUT_S = 10.0


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
    request: Request,
    response: Response,
    state: State,
    caller: Caller,
    idempotency_key: Annotated[
        str | None,
        Header(
            description="For a caller without its own event ids: the same key within "
            "HOOKLINE_DEDUPE_WINDOW_S is the same event (sent with another request: 422)."
        ),
    ] = None,
) -> EventAccepted:
    # Read the body ourselves: the size limit applies while streaming, and malformed JSON is a 400.
    raw = await request.body()
    try:
        event_in = EventIn.model_validate_json(raw)
    except ValidationError as exc:
        raise invalid_input(exc.errors()) from None
    trace = tracing.from_headers(request.headers)
    accepted = await _accept(state, caller, event_in, idempotency_key=idempotency_key, trace=trace)
    if accepted.duplicate:
        response.status_code = 200
    return accepted


@router.post(
    "/batch",
    response_model=BatchAccepted,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": BatchIn.model_json_schema()}},
        }
    },
)
async def publish_batch(request: Request, state: State, caller: Caller) -> BatchAccepted:
    """Up to ``BATCH_MAX`` events, published at once (their confirms come back in one round): a result
    per item, in order. An item refused (invalid, another tenant's, not confirmed) does not stop the others."""
    raw = await request.body()
    trace = tracing.from_headers(request.headers)  # the batch's, for every event in it
    try:
        items = BatchIn.model_validate_json(raw).events
    except ValidationError as exc:
        raise invalid_input(exc.errors()) from None

    async def one(index: int, item: dict[str, Any]) -> BatchItem:
        try:
            event_in = EventIn.model_validate(item)
        except ValidationError as exc:
            return BatchItem.refused(index, invalid_input(exc.errors()))
        try:
            accepted = await _accept(state, caller, event_in, idempotency_key=None, trace=trace)
        except ApiError as error:
            return BatchItem.refused(index, error)
        return BatchItem(index=index, status=200 if accepted.duplicate else 202, event=accepted)

    results = await asyncio.gather(*(one(index, item) for index, item in enumerate(items)))
    log.info(
        "events_batch",
        events=len(results),
        accepted=sum(r.status == 202 for r in results),
        duplicates=sum(r.status == 200 for r in results),
        refused=sum(r.status >= 400 for r in results),
    )
    return BatchAccepted(results=results)


async def _accept(
    state: IngestState,
    caller: Caller,
    event_in: EventIn,
    *,
    idempotency_key: str | None,
    trace: TraceContext | None,
) -> EventAccepted:
    """Publish one event, unless it was accepted before (then say when); raises :class:`ApiError`."""
    caller.require(event_in.tenant)
    if event_in.tenant == OPERATOR_TENANT:
        raise ApiError(
            422, "invalid_fields", f"tenant {OPERATOR_TENANT!r} is reserved for hookline's own notifications"
        )
    warnings = catalog_warnings(state.change_log.catalog, event_in)
    digest = _key_digest(idempotency_key, event_in)
    event_id = event_in.id or (
        event_id_for_key(event_in.tenant, idempotency_key) if idempotency_key else new_id("evt")
    )
    async with state.duplicates.claim(event_in.tenant, event_id) as claim:
        if claim.previous is not None:
            return _duplicate(claim.previous, event_id, event_in.tenant, digest)
        now = _to_ms(datetime.now(UTC))  # what the event log's header keeps, and a duplicate is told
        event = event_in.complete(event_id=event_id, now=now)
        # After the duplicate check: a retried request is answered, not counted again.
        await state.quotas.check_event(
            event.tenant, size_bytes=lambda: len(event.model_dump_json()), now_s=now.timestamp()
        )
        attributes = {
            "hookline.event_id": event.id,
            "hookline.event_type": event.type,
            "hookline.tenant": event.tenant,
        }
        with state.tracing.span("hookline.publish", trace, attributes, kind=SpanKind.PRODUCER) as (
            context,
            _,
        ):
            await _publish(
                state.publisher,
                state.settings.max_payload_bytes,
                event,
                accepted_at=now,
                request_digest=digest,
                trace=context,
            )
        claim.accepted = Acceptance(type=event.type, accepted_at_s=now.timestamp(), request_digest=digest)
    return EventAccepted(
        id=event.id, tenant=event.tenant, type=event.type, accepted_at=now, warnings=warnings
    )


def _key_digest(idempotency_key: str | None, event_in: EventIn) -> str | None:
    """The request's digest when it names an Idempotency-Key (to tell a retry from another request
    under the same key), after checking the key."""
    if idempotency_key is None:
        return None
    if not 0 < len(idempotency_key) <= IDEMPOTENCY_KEY_MAX or not idempotency_key.isprintable():
        raise ApiError(
            422,
            "invalid_idempotency_key",
            "invalid value for: Idempotency-Key",
            [
                ErrorDetail(
                    field="Idempotency-Key",
                    message=f"must be 1 to {IDEMPOTENCY_KEY_MAX} printable characters",
                )
            ],
        )
    return request_digest(event_in)


def _duplicate(previous: Acceptance, event_id: str, tenant: str, digest: str | None) -> EventAccepted:
    """The answer to an event accepted before: when, and as which type; a key sent with another
    request is refused instead."""
    if digest is not None and previous.request_digest not in (None, digest):
        raise ApiError(
            422,
            "idempotency_key_reused",
            "this Idempotency-Key was sent with another request; use a new key for a new event",
            [ErrorDetail(field="Idempotency-Key", message="already used for another request")],
        )
    log.info("event_duplicate", event_id=event_id, tenant=tenant)
    return EventAccepted(
        id=event_id,
        tenant=tenant,
        type=previous.type,
        accepted_at=datetime.fromtimestamp(previous.accepted_at_s, UTC),
        duplicate=True,
    )


def catalog_warnings(catalog: Catalog, event_in: EventFields) -> list[str]:
    """What the event-type catalog says of this event: a 422 when its type enforces its schema, else
    warnings for the answer (and the log, which names places in the data, never the data)."""
    violation = catalog.check(event_in.type, event_in.schema_version, event_in.data)
    warnings = []
    if violation is not None:
        if violation.validation == "enforce":
            raise ApiError(
                422,
                "invalid_event",
                f"the event does not match the schema of {event_in.type} (schema_version "
                f"{event_in.schema_version}) in the event-type catalog",
                [ErrorDetail(field=pointer, message=message) for pointer, message in violation.problems],
            )
        warnings.append(f"does not match the schema of {event_in.type}: {violation.describe()}")
        log.warning(
            "event_schema_mismatch", tenant=event_in.tenant, type=event_in.type, at=violation.pointers()
        )
    described = catalog.get(event_in.type)
    if described is not None and described.deprecated:
        warnings.append(f"{event_in.type} is deprecated in the event-type catalog")
    return warnings


def _to_ms(moment: datetime) -> datetime:
    return moment.replace(microsecond=moment.microsecond // 1000 * 1000)


async def _publish(
    publisher: Publisher,
    max_payload_bytes: int,
    event: Event,
    *,
    accepted_at: datetime,
    request_digest: str | None,
    trace: TraceContext | None,
) -> None:
    body = event.model_dump_json(exclude_none=True).encode()
    if len(body) > max_payload_bytes:
        raise ApiError(
            413, "payload_too_large", "the event exceeds HOOKLINE_MAX_PAYLOAD_BYTES once completed"
        )
    try:
        await publisher.publish(
            event_message(event, body, accepted_at=accepted_at, request_digest=request_digest, trace=trace),
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
