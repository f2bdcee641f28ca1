"""``POST /v1/endpoints/{id}/test``: a test event sent to one endpoint now, and its attempt shown at once
(status, timings, the start of the answer), as Stripe's and Svix's "send test event". Its data is the
event-type catalog's first example of the type, or the ``data`` given. It is signed and shaped as every
delivery to that endpoint (its body format, headers and auth), and the delivery log keeps the attempt as
kind ``test``, beside any event's course: nothing is published to ``events``, no other endpoint gets it,
no retry follows, and the breaker and the statistics ignore it. Paused, disabled and unverified
endpoints can be tested too: that is when a customer most wants to."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import structlog
from fastapi import APIRouter
from pydantic import Field

from hookline.ingest import polling
from hookline.ingest.auth import Caller
from hookline.ingest.events import catalog_warnings
from hookline.ingest.state import State
from hookline.ingest.tracking import EndpointAttempt, attempt_view
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import Event, EventType, Model
from hookline.shared.outbound.sealing import SealedSecretError
from hookline.shared.runtime.api import ApiError

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/v1/endpoints", tags=["endpoints"])


class TestEventRequest(Model):
    type: EventType
    data: dict[str, Any] | None = None  # None: the catalog's first example of ``type``
    subject: str | None = Field(None, min_length=1, max_length=256)
    schema_version: int = Field(1, ge=1)


class TestEventAttempt(EndpointAttempt):
    type: str
    warnings: list[str]  # what the catalog says of the event (a schema it does not match, deprecated)


@router.post("/{endpoint_id}/test", response_model=TestEventAttempt)
async def send_test_event(
    endpoint_id: str, request: TestEventRequest, state: State, caller: Caller
) -> TestEventAttempt:
    endpoint = caller.endpoint(state.registry, endpoint_id)
    polling.refuse_if_polling(endpoint, "a test event")
    catalog = state.change_log.catalog
    data = request.data
    if data is None:
        described = catalog.get(request.type)
        if described is None or not described.examples:
            raise ApiError(
                422,
                "no_example",
                f"the event-type catalog has no example of {request.type}: send the test's data",
            )
        data = described.examples[0]
    event = Event(
        id=new_id("evt"), type=request.type, tenant=endpoint.tenant, occurred_at=datetime.now(UTC),
        subject=request.subject, schema_version=request.schema_version, data=data,
    )  # fmt: skip
    warnings = catalog_warnings(catalog, event)  # an enforced schema refuses it here, as when published
    body = event.model_dump_json(exclude_none=True).encode()
    if len(body) > state.settings.max_payload_bytes:
        raise ApiError(413, "payload_too_large", "the test event exceeds HOOKLINE_MAX_PAYLOAD_BYTES")
    try:
        _, record = await state.attempts.make(
            endpoint, event_id=event.id, event_type=event.type, body=body, kind="test", number=1
        )
    except SealedSecretError as exc:
        raise ApiError(503, "secret_unavailable", str(exc)) from None
    log.info(
        "endpoint_tested",
        endpoint_id=endpoint.id,
        tenant=endpoint.tenant,
        event_id=event.id,
        type=event.type,
        status=record.status,
    )
    await state.trail.record(
        caller, "endpoint.tested", tenant=endpoint.tenant, target=endpoint.id,
        changes={"event_id": event.id, "type": event.type, "status": record.status},
    )  # fmt: skip
    return TestEventAttempt(
        event_id=event.id, endpoint_id=endpoint.id, type=event.type, warnings=warnings,
        **attempt_view(state.sealer, record).model_dump(),
    )  # fmt: skip
