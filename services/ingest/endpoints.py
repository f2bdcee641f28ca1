"""``/v1/endpoints``: register, read, change, verify, rotate, pause and delete a tenant's endpoints.

A change is durable once it is in the endpoint change log; the endpoint's queue and its bindings to
``events`` are set up before the record is written, so an event published right after a ``201`` is
already queued for the new endpoint (it is delivered once the endpoint is verified).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Annotated

import structlog
from aio_pika.abc import AbstractRobustQueue
from fastapi import APIRouter, Depends, Query, Response

from hookline.ingest.auth import Caller
from hookline.ingest.state import IngestState, ingest_state
from hookline.ingest.verification import verify
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
    RotatedSecret,
    RotateSecret,
    SigningSecret,
    StoredEndpoint,
)
from hookline.shared.signing import generate_secret
from hookline.shared.targets import registration_refusal

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/v1/endpoints", tags=["endpoints"])
State = Annotated[IngestState, Depends(ingest_state)]


def _invalid(field: str, message: str) -> ApiError:
    return ApiError(
        422, "invalid_fields", f"invalid value for: {field}", [ErrorDetail(field=field, message=message)]
    )


async def _check_target(url: str, state: IngestState) -> None:
    """Refuse, naming the reason, a URL hookline would not call (scheme, private or reserved addresses)."""
    refusal = await registration_refusal(
        url, allow_http=state.settings.allow_http, allow_private=state.settings.allow_private_targets
    )
    if refusal is not None:
        raise _invalid("url", refusal)


def _stored(state: IngestState, endpoint_id: str, caller: Caller) -> StoredEndpoint:
    endpoint = state.registry.get(endpoint_id)
    # Another tenant's endpoint is "not found": its existence is not theirs to know.
    if endpoint is None or not caller.may_see(endpoint.tenant):
        raise ApiError(404, "not_found", f"no endpoint {endpoint_id}")
    return endpoint


async def _queue(state: IngestState, endpoint: StoredEndpoint) -> AbstractRobustQueue:
    # Not robust: the ingest declares once; dispatchers own consuming and restoring.
    return await topology.endpoint_queue_declare(
        state.admin, endpoint.id, single_consumer=endpoint.single_consumer, robust=False
    )


async def _write(state: IngestState, endpoint: StoredEndpoint, now: datetime) -> None:
    record = EndpointUpserted(change_id=f"chg_{uuid.uuid4().hex}", at=now, endpoint=endpoint)
    await state.change_log.append(record, timeout_s=state.settings.registry_wait_s)


async def _verified(state: IngestState, endpoint: StoredEndpoint) -> StoredEndpoint:
    """Run the handshake and record its result (deliveries start once ``verified`` is true)."""
    result = await verify(state, endpoint)
    after = endpoint.model_copy(
        update={"verified": result.ok, "verification": result, "updated_at": result.at}
    )
    await _write(state, after, result.at)
    log.info(
        "endpoint_verification",
        endpoint_id=endpoint.id,
        tenant=endpoint.tenant,
        ok=result.ok,
        status=result.status,
    )
    return after


@router.post("", status_code=201, response_model=EndpointCreated)
async def create_endpoint(spec: EndpointCreate, state: State, caller: Caller) -> EndpointCreated:
    caller.require(spec.tenant)
    await _check_target(spec.url, state)
    now = datetime.now(UTC)
    secret = generate_secret()
    endpoint = StoredEndpoint(
        id=new_id("ep"),
        **spec.model_dump(exclude={"verify"}),
        status=EndpointStatus.ACTIVE,
        verified=not spec.verify,
        created_at=now,
        updated_at=now,
        secrets=[SigningSecret(value=state.sealer.seal(secret), created_at=now)],
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
    if spec.verify:
        endpoint = await _verified(state, endpoint)
    return EndpointCreated(**endpoint.public().model_dump(), secret=secret)


@router.get("", response_model=EndpointList)
async def list_endpoints(
    state: State,
    caller: Caller,
    tenant: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[
        str | None, Query(max_length=64, description="return endpoints created after this id")
    ] = None,
) -> EndpointList:
    tenant = caller.scope(tenant)
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
async def get_endpoint(endpoint_id: str, state: State, caller: Caller) -> Endpoint:
    return _stored(state, endpoint_id, caller).public()


@router.get("/{endpoint_id}/secret", response_model=EndpointSecret)
async def get_secret(endpoint_id: str, state: State, caller: Caller) -> EndpointSecret:
    return EndpointSecret(secret=state.sealer.open(_stored(state, endpoint_id, caller).secrets[0].value))


@router.patch("/{endpoint_id}", response_model=Endpoint)
async def update_endpoint(endpoint_id: str, change: EndpointUpdate, state: State, caller: Caller) -> Endpoint:
    before = _stored(state, endpoint_id, caller)
    changes = change.model_dump(exclude_unset=True, exclude={"verify"})
    for field in ("url", "event_types"):
        if field in changes and changes[field] is None:
            raise _invalid(field, "must not be null")
    if "url" in changes:
        await _check_target(changes["url"], state)
    after = StoredEndpoint.model_validate({**before.model_dump(), **changes, "updated_at": datetime.now(UTC)})
    if after.single_consumer and not before.single_consumer:
        # The limits are enforced by serving the endpoint from one dispatcher at a time, a property of
        # its queue fixed when the queue was declared.
        raise _invalid(
            "max_in_flight" if "max_in_flight" in changes else "rate_limit_per_s",
            "limits can only be changed on an endpoint created with one; create a new endpoint with the limit",
        )
    old_keys = topology.binding_keys(before.tenant, before.event_types)
    new_keys = topology.binding_keys(after.tenant, after.event_types)
    if old_keys != new_keys:
        queue = await _queue(state, after)
        # Bind the new patterns before unbinding the old ones, so no event falls between them.
        for key in sorted(new_keys - old_keys):
            await queue.bind(state.events, routing_key=key, robust=False)
        for key in sorted(old_keys - new_keys):
            await queue.unbind(state.events, routing_key=key)
    url_changed = after.url != before.url
    if url_changed and change.verify:
        after = after.model_copy(update={"verified": False})
    await _write(state, after, after.updated_at)
    log.info("endpoint_updated", endpoint_id=endpoint_id, tenant=after.tenant, fields=sorted(changes))
    if url_changed and change.verify:
        after = await _verified(state, after)
    return after.public()


@router.post("/{endpoint_id}/verify", response_model=Endpoint)
async def verify_endpoint(endpoint_id: str, state: State, caller: Caller) -> Endpoint:
    """Run the verification handshake again (after fixing the receiver)."""
    return (await _verified(state, _stored(state, endpoint_id, caller))).public()


@router.post("/{endpoint_id}/rotate-secret", response_model=RotatedSecret)
async def rotate_secret(
    endpoint_id: str, state: State, caller: Caller, request: RotateSecret | None = None
) -> RotatedSecret:
    """A new secret signs from now on; the previous one keeps signing too until the overlap ends."""
    before = _stored(state, endpoint_id, caller)
    now = datetime.now(UTC)
    overlap_s = (
        request.overlap_s
        if request and request.overlap_s is not None
        else state.settings.secret_rotation_overlap_s
    )
    expires_at = now + timedelta(seconds=overlap_s)
    previous = [
        secret.model_copy(update={"expires_at": min(secret.expires_at or expires_at, expires_at)})
        for secret in before.secrets
        if secret.expires_at is None or secret.expires_at > now
    ]
    secret = generate_secret()
    after = before.model_copy(
        update={
            "secrets": [SigningSecret(value=state.sealer.seal(secret), created_at=now), *previous],
            "updated_at": now,
        }
    )
    await _write(state, after, now)
    log.info("endpoint_secret_rotated", endpoint_id=endpoint_id, tenant=after.tenant, overlap_s=overlap_s)
    return RotatedSecret(secret=secret, previous_expires_at=expires_at)


async def _set_status(
    state: IngestState, endpoint_id: str, caller: Caller, status: EndpointStatus
) -> Endpoint:
    before = _stored(state, endpoint_id, caller)
    now = datetime.now(UTC)
    after = before.model_copy(update={"status": status, "updated_at": now})
    await _write(state, after, now)
    log.info("endpoint_status_changed", endpoint_id=endpoint_id, tenant=after.tenant, status=status.value)
    return after.public()


@router.post("/{endpoint_id}/pause", response_model=Endpoint)
async def pause_endpoint(endpoint_id: str, state: State, caller: Caller) -> Endpoint:
    """Stop deliveries; events keep queueing for the endpoint and nothing is attempted."""
    return await _set_status(state, endpoint_id, caller, EndpointStatus.PAUSED)


@router.post("/{endpoint_id}/resume", response_model=Endpoint)
async def resume_endpoint(endpoint_id: str, state: State, caller: Caller) -> Endpoint:
    """Deliver again, a paused endpoint or one disabled after a 410: what queued meanwhile goes out."""
    return await _set_status(state, endpoint_id, caller, EndpointStatus.ACTIVE)


@router.delete("/{endpoint_id}", status_code=204)
async def delete_endpoint(
    endpoint_id: str,
    state: State,
    caller: Caller,
    force: Annotated[
        bool, Query(description="delete even with events pending; they become dead letters")
    ] = False,
) -> Response:
    endpoint = _stored(state, endpoint_id, caller)
    queue = await _queue(state, endpoint)
    pending = queue.declaration_result.message_count or 0
    if pending and not force:
        raise ApiError(
            409,
            "events_pending",
            f"{pending} events are waiting for this endpoint; delete with ?force=true to dead-letter them",
        )
    # 1. No new events for it, and no retries either: those become unroutable, then dead letters.
    for key in topology.binding_keys(endpoint.tenant, endpoint.event_types):
        await queue.unbind(state.events, routing_key=key)
    await queue.unbind(topology.DELAY_DELIVERY, routing_key=topology.delay_delivery_binding(queue.name))
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
