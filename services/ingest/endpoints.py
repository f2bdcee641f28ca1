"""``/v1/endpoints``: register, read, change and delete a tenant's endpoints.

A change is durable once it is in the endpoint change log; the endpoint's queue and its bindings to
``events`` are set up before the record is written, so an event published right after a ``201`` is
already queued for the new endpoint.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated
from urllib.parse import urlsplit

import structlog
from aio_pika.abc import AbstractRobustQueue
from fastapi import APIRouter, Depends, Query, Response

from hookline.ingest.state import IngestState, ingest_state
from hookline.shared import topology
from hookline.shared.api import ApiError
from hookline.shared.deadletters import dead_letter_message
from hookline.shared.ids import new_id
from hookline.shared.models import (
    DeadLetterReason,
    Endpoint,
    EndpointCreate,
    EndpointCreated,
    EndpointDeleted,
    EndpointList,
    EndpointSecret,
    EndpointStatus,
    EndpointUpdate,
    EndpointUpserted,
    ErrorDetail,
    SigningSecret,
    StoredEndpoint,
)
from hookline.shared.signing import generate_secret

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/v1/endpoints", tags=["endpoints"])
State = Annotated[IngestState, Depends(ingest_state)]


def _check_url_policy(url: str, state: IngestState) -> None:
    if urlsplit(url).scheme != "https" and not state.settings.allow_http:
        raise ApiError(
            422,
            "invalid_fields",
            "invalid value for: url",
            [ErrorDetail(field="url", message="must be https (HOOKLINE_ALLOW_HTTP is off)")],
        )


def _stored(state: IngestState, endpoint_id: str) -> StoredEndpoint:
    endpoint = state.registry.get(endpoint_id)
    if endpoint is None:
        raise ApiError(404, "not_found", f"no endpoint {endpoint_id}")
    return endpoint


async def _queue(state: IngestState, endpoint: StoredEndpoint) -> AbstractRobustQueue:
    # Not robust: the ingest declares once; dispatchers own consuming and restoring.
    return await topology.endpoint_queue_declare(
        state.admin, endpoint.id, ordered=endpoint.ordered, robust=False
    )


async def _write(state: IngestState, endpoint: StoredEndpoint, now: datetime) -> None:
    record = EndpointUpserted(change_id=f"chg_{uuid.uuid4().hex}", at=now, endpoint=endpoint)
    await state.change_log.append(record, timeout_s=state.settings.registry_wait_s)


@router.post("", status_code=201, response_model=EndpointCreated)
async def create_endpoint(spec: EndpointCreate, state: State) -> EndpointCreated:
    _check_url_policy(spec.url, state)
    now = datetime.now(UTC)
    secret = generate_secret()
    endpoint = StoredEndpoint(
        id=new_id("ep"),
        **spec.model_dump(),
        status=EndpointStatus.ACTIVE,
        created_at=now,
        updated_at=now,
        secrets=[SigningSecret(value=secret, created_at=now)],
    )
    queue = await _queue(state, endpoint)
    for key in topology.binding_keys(endpoint.tenant, endpoint.event_types):
        await queue.bind(state.events, routing_key=key, robust=False)
    # Retries come back to the queue through the delay hierarchy's delivery exchange.
    await queue.bind(
        topology.DELAY_DELIVERY, routing_key=topology.delay_delivery_binding(queue.name), robust=False
    )
    await _write(state, endpoint, now)
    log.info("endpoint_created", endpoint_id=endpoint.id, tenant=endpoint.tenant)
    return EndpointCreated(**endpoint.public().model_dump(), secret=secret)


@router.get("", response_model=EndpointList)
async def list_endpoints(
    state: State,
    tenant: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[
        str | None, Query(max_length=64, description="return endpoints created after this id")
    ] = None,
) -> EndpointList:
    # Ids are ULIDs, so sorting by id lists endpoints in creation order and makes `after` a stable cursor.
    endpoints = sorted(state.registry.all(), key=lambda endpoint: endpoint.id)
    selected = [
        endpoint.public()
        for endpoint in endpoints
        if (tenant is None or endpoint.tenant == tenant) and (after is None or endpoint.id > after)
    ]
    page = selected[:limit]
    return EndpointList(data=page, next_after=page[-1].id if len(selected) > limit else None)


@router.get("/{endpoint_id}", response_model=Endpoint)
async def get_endpoint(endpoint_id: str, state: State) -> Endpoint:
    return _stored(state, endpoint_id).public()


@router.get("/{endpoint_id}/secret", response_model=EndpointSecret)
async def get_secret(endpoint_id: str, state: State) -> EndpointSecret:
    return EndpointSecret(secret=_stored(state, endpoint_id).secrets[0].value)


@router.patch("/{endpoint_id}", response_model=Endpoint)
async def update_endpoint(endpoint_id: str, change: EndpointUpdate, state: State) -> Endpoint:
    before = _stored(state, endpoint_id)
    changes = change.model_dump(exclude_unset=True)
    if "url" in changes:
        if changes["url"] is None:
            raise ApiError(
                422,
                "invalid_fields",
                "invalid value for: url",
                [ErrorDetail(field="url", message="must not be null")],
            )
        _check_url_policy(changes["url"], state)
    if "event_types" in changes and changes["event_types"] is None:
        raise ApiError(
            422,
            "invalid_fields",
            "invalid value for: event_types",
            [ErrorDetail(field="event_types", message="must not be null")],
        )
    now = datetime.now(UTC)
    after = StoredEndpoint.model_validate({**before.model_dump(), **changes, "updated_at": now})
    old_keys = topology.binding_keys(before.tenant, before.event_types)
    new_keys = topology.binding_keys(after.tenant, after.event_types)
    if old_keys != new_keys:
        queue = await _queue(state, after)
        # Bind the new patterns before unbinding the old ones, so no event falls between them.
        for key in sorted(new_keys - old_keys):
            await queue.bind(state.events, routing_key=key, robust=False)
        for key in sorted(old_keys - new_keys):
            await queue.unbind(state.events, routing_key=key)
    await _write(state, after, now)
    log.info("endpoint_updated", endpoint_id=endpoint_id, tenant=after.tenant, fields=sorted(changes))
    return after.public()


@router.delete("/{endpoint_id}", status_code=204)
async def delete_endpoint(endpoint_id: str, state: State) -> Response:
    endpoint = _stored(state, endpoint_id)
    queue = await _queue(state, endpoint)
    # 1. No new events for it.
    for key in topology.binding_keys(endpoint.tenant, endpoint.event_types):
        await queue.unbind(state.events, routing_key=key)
    # 2. Dispatchers stop consuming once they read the deletion.
    now = datetime.now(UTC)
    await state.change_log.append(
        EndpointDeleted(change_id=f"chg_{uuid.uuid4().hex}", at=now, endpoint_id=endpoint_id),
        timeout_s=state.settings.registry_wait_s,
    )
    # 3. What is still queued is kept as dead letters, never dropped with the queue. Deliveries that
    #    dispatchers hold right now finish on their own: delivered, or dead-lettered as endpoint_gone.
    #    (Quorum queues refuse queue.delete with if-empty, and unacked messages are invisible here.)
    moved = await _drain_to_dead_letters(state, queue, endpoint, now)
    await queue.delete(if_unused=False, if_empty=False)
    log.info("endpoint_deleted", endpoint_id=endpoint_id, tenant=endpoint.tenant, dead_lettered=moved)
    return Response(status_code=204)


async def _drain_to_dead_letters(
    state: IngestState, queue: AbstractRobustQueue, endpoint: StoredEndpoint, now: datetime
) -> int:
    moved = 0
    while (message := await queue.get(no_ack=False, fail=False)) is not None:
        await state.dead_letters.publish(
            dead_letter_message(
                message.body,
                reason=DeadLetterReason.ENDPOINT_GONE,
                endpoint_id=endpoint.id,
                tenant=endpoint.tenant,
                event_id=message.message_id,
                attempts=0,
                last_status=None,
                last_error="the endpoint was deleted",
                now=now,
            ),
            routing_key="",
        )
        await message.ack()
        moved += 1
    return moved


async def _set_status(state: IngestState, endpoint_id: str, status: EndpointStatus) -> Endpoint:
    before = _stored(state, endpoint_id)
    now = datetime.now(UTC)
    after = before.model_copy(update={"status": status, "updated_at": now})
    await _write(state, after, now)
    log.info("endpoint_status_changed", endpoint_id=endpoint_id, tenant=after.tenant, status=status.value)
    return after.public()


@router.post("/{endpoint_id}/pause", response_model=Endpoint)
async def pause_endpoint(endpoint_id: str, state: State) -> Endpoint:
    """Stop deliveries; events keep queueing for the endpoint and nothing is attempted."""
    return await _set_status(state, endpoint_id, EndpointStatus.PAUSED)


@router.post("/{endpoint_id}/resume", response_model=Endpoint)
async def resume_endpoint(endpoint_id: str, state: State) -> Endpoint:
    """Deliver again, a paused endpoint or one disabled after a 410: what queued meanwhile goes out."""
    return await _set_status(state, endpoint_id, EndpointStatus.ACTIVE)
