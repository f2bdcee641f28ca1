"""``/v1/endpoints``: register, read, change, verify, rotate, pause and delete a tenant's endpoints.

A change is durable once it is in the endpoint change log. Every write is conditional on the version it
was based on: the caller's ``If-Match`` when given, else the version this request read; when another
write got there first the answer is 409 with the current version, never a silent overwrite.

An endpoint costs the broker nothing of its own unless it needs isolation (:mod:`hookline.shared.
placement`): then its queue of its own is declared before its record is written, so nothing handed to it
is lost. A new endpoint (or new patterns) is answered for only once every live dispatcher has applied
its record (replicas.py), and only then is a pattern its lane did not have bound: an event published
after the ``201`` reaches it, whichever dispatcher takes the event. The verification handshake runs
before the record is written, so an endpoint that answers it is never isolated for being unverified.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Header, Query, Response
from pydantic import ValidationError

from hookline.ingest import audit, notifiers, polling, queues, writes
from hookline.ingest.audit import AuditTarget, AuditTrail
from hookline.ingest.auth import Caller
from hookline.ingest.schemas import (
    POLLING_FIELDS,
    EndpointBatch,
    EndpointBatchCreated,
    EndpointBatchItem,
    EndpointCreate,
    EndpointCreated,
    EndpointList,
    EndpointSecret,
    EndpointUpdate,
    RotatedSecret,
    RotateSecret,
)
from hookline.ingest.state import IngestState, Registry, State
from hookline.ingest.verification import verify
from hookline.shared.broker import topology
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import (
    Endpoint,
    EndpointDeleted,
    EndpointStatus,
    SigningSecret,
    StoredEndpoint,
)
from hookline.shared.outbound.signing import generate_secret
from hookline.shared.runtime.api import ApiError, broker_unavailable, invalid_input
from hookline.shared.state import notifications
from hookline.shared.state.catalog import Catalog
from hookline.shared.state.changefold import Stale
from hookline.shared.state.registry import StaleWriteError

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/v1/endpoints", tags=["endpoints"])

IfMatch = Annotated[
    str | None,
    Header(description="the endpoint version (its ETag) this change is based on; 409 if it is not current"),
]

#: Endpoints of one batch prepared at once (each its checks and handshake); all then written in one record.
BATCH_CONCURRENCY = 64


async def _audit(
    trail: AuditTrail, caller: Caller, action: str, before: StoredEndpoint | None, after: StoredEndpoint
) -> None:
    changes = audit.changes_between(before, after)
    await trail.record(caller, action, tenant=after.tenant, target=after.id, changes=changes)


def _may_skip_verification(caller: Caller, *, verify: bool) -> None:
    # Unverified, a tenant could point its deliveries at a third party that never agreed to them.
    if not verify:
        caller.require_admin('skip verification ("verify": false)')


def _reserved(tenant: str) -> None:
    if tenant == notifications.OPERATOR_TENANT:
        raise writes.invalid("tenant", f"{tenant!r} is reserved for hookline's own notifications")


def _etag(response: Response, endpoint: StoredEndpoint) -> None:
    response.headers["ETag"] = f'"{endpoint.version}"'


async def _handshake(state: IngestState, endpoint: StoredEndpoint) -> StoredEndpoint:
    """The endpoint (not written yet) with the result of its verification handshake."""
    result = await verify(state.attempts, endpoint)
    log.info(
        "endpoint_verification", endpoint_id=endpoint.id, tenant=endpoint.tenant, ok=result.ok,
        status=result.status, recorded=False,
    )  # fmt: skip
    return endpoint.model_copy(
        update={"verified": result.ok, "verification": result, "updated_at": result.at}
    )


async def _record_verification(state: IngestState, endpoint: StoredEndpoint) -> StoredEndpoint:
    """Run the handshake, then record its result on the endpoint as it is by then: a rotation or an edit
    made while the receiver was answering survives (the write is re-read and retried if another one
    wins). A result for a URL that has changed meanwhile is not recorded."""
    result = await verify(state.attempts, endpoint)

    def verified(current: StoredEndpoint) -> StoredEndpoint | None:
        if current.url != endpoint.url:
            return None
        return current.model_copy(
            update={"verified": result.ok, "verification": result, "updated_at": result.at}
        )

    written = await state.change_log.update(endpoint.id, verified, timeout_s=state.settings.registry_wait_s)
    log.info(
        "endpoint_verification",
        endpoint_id=endpoint.id,
        tenant=endpoint.tenant,
        ok=result.ok,
        status=result.status,
        recorded=written is not None,
    )
    return written or state.registry.get(endpoint.id) or endpoint


@router.post("", status_code=201, response_model=EndpointCreated)
async def create_endpoint(
    spec: EndpointCreate, state: State, caller: Caller, response: Response
) -> EndpointCreated:
    created = await _create(state, caller, spec)
    await queues.activate(state, created.endpoint, patterns=created.endpoint.event_types)
    await _created(state, caller, created)
    _etag(response, created.endpoint)
    return created.answer


@router.post("/batch", response_model=EndpointBatchCreated)
async def create_endpoints(batch: EndpointBatch, state: State, caller: Caller) -> EndpointBatchCreated:
    """Up to BATCH_MAX endpoints at once: each created as ``POST /v1/endpoints`` would (a result per
    item, in order; one refused does not stop the others), written in one record, and the whole batch
    answered once every live dispatcher has applied it (one wait, not one each)."""
    slots = asyncio.Semaphore(BATCH_CONCURRENCY)

    async def one(index: int, item: dict[str, Any]) -> _Prepared | EndpointBatchItem:
        try:
            spec = EndpointCreate.model_validate(item)
        except ValidationError as exc:
            return EndpointBatchItem.refused(index, invalid_input(exc.errors()))
        async with slots:
            try:
                return await _prepare(state, caller, spec)
            except ApiError as error:
                return EndpointBatchItem.refused(index, error)

    outcomes = await asyncio.gather(*(one(index, item) for index, item in enumerate(batch.endpoints)))
    prepared = [outcome for outcome in outcomes if isinstance(outcome, _Prepared)]
    # One record for the batch (EndpointsUpserted): one publish and one read-back, not one each.
    written = iter(
        await state.change_log.create_many(
            [p.endpoint for p in prepared], timeout_s=state.settings.registry_wait_s
        )
        if prepared
        else []
    )
    results: list[EndpointBatchItem] = []
    created: list[_Created] = []
    for index, outcome in enumerate(outcomes):
        if isinstance(outcome, _Prepared):
            endpoint = next(written)
            if isinstance(endpoint, Stale):  # an id taken already: not one of ours, so never in practice
                outcome = EndpointBatchItem.refused(index, writes.changed(endpoint.current))
            else:
                created.append(_answer(state, outcome, endpoint))
                outcome = EndpointBatchItem(index=index, status=201, endpoint=created[-1].answer)
        results.append(outcome)
    if created:
        await queues.activate_all(state, [c.endpoint for c in created])
        targets = []
        for endpoint in (c.endpoint for c in created):
            _log_created(state, endpoint)
            targets.append(AuditTarget(endpoint.tenant, endpoint.id, audit.changes_between(None, endpoint)))
        await state.trail.record_many(caller, "endpoint.created", targets)
    log.info(
        "endpoints_batch", endpoints=len(results), created=len(created), refused=len(results) - len(created)
    )
    return EndpointBatchCreated(results=results)


@dataclass(frozen=True, slots=True)
class _Prepared:
    """An endpoint checked and handshaken, not written yet, with what its answer shows once only."""

    endpoint: StoredEndpoint
    secret: str
    notifier: StoredEndpoint | None
    poll_token: str | None = None


@dataclass(frozen=True, slots=True)
class _Created:
    endpoint: StoredEndpoint
    answer: EndpointCreated


async def _create(state: IngestState, caller: Caller, spec: EndpointCreate) -> _Created:
    """An endpoint prepared and written; not answered for yet (``queues.activate``)."""
    prepared = await _prepare(state, caller, spec)
    return _answer(state, prepared, await writes.write(state, prepared.endpoint, base_version=0))


async def _prepare(state: IngestState, caller: Caller, spec: EndpointCreate) -> _Prepared:
    """An endpoint checked, handshaken (unless skipped), with its notifier registered and its queue of
    its own if it needs one; not written yet."""
    caller.require(spec.tenant)
    polls = spec.kind == "polling"  # nothing is sent to it: no target to check, no handshake
    _may_skip_verification(caller, verify=spec.verify or polls)
    _reserved(spec.tenant)
    state.quotas.check_endpoints(spec.tenant)
    if spec.url is not None:
        await writes.check_target(spec.url, state.settings)
    now = datetime.now(UTC)
    secret = generate_secret()
    poll_token = polling.new_token() if polls else None
    sealed = await writes.endpoint_credentials(state, {"headers": None, "auth": None}, spec)
    endpoint = StoredEndpoint(
        id=new_id("ep"),
        **spec.model_dump(exclude={"verify", "headers", "auth"}),
        **sealed,
        status=EndpointStatus.ACTIVE,
        created_at=now,
        updated_at=now,
        secrets=[SigningSecret(value=state.sealer.seal(secret), created_at=now)],
        routed=True,
        # Ordered: its queue of its own bound to events as it is declared, before the record (models.py).
        # Polling: laned as a new endpoint is (nothing to move at start), passed over by the fan-out.
        laned=not spec.ordered,
        straight=spec.ordered,
        poll_token_hash=polling.token_hash(poll_token) if poll_token else None,
    )
    notifier = await notifiers.notifier(state, endpoint)
    if spec.verify and not polls:
        endpoint = await _handshake(state, endpoint)
    await queues.own_queue_if_isolated(state, None, endpoint)
    return _Prepared(endpoint, secret, notifier, poll_token)


def _answer(state: IngestState, prepared: _Prepared, endpoint: StoredEndpoint) -> _Created:
    """The answer for an endpoint just written: its secret and its notifier's shown this once."""
    notifier = prepared.notifier
    answer = EndpointCreated(
        **endpoint.public().model_dump(),
        secret=prepared.secret,
        poll_token=prepared.poll_token,
        notify_secret=state.sealer.open(notifier.secrets[0].value) if notifier else None,
        warnings=_pattern_warnings(state.change_log.catalog, endpoint),
    )
    return _Created(endpoint, answer)


async def _created(state: IngestState, caller: Caller, created: _Created) -> None:
    _log_created(state, created.endpoint)
    await _audit(state.trail, caller, "endpoint.created", None, created.endpoint)


def _log_created(state: IngestState, endpoint: StoredEndpoint) -> None:
    log.info(
        "endpoint_created",
        endpoint_id=endpoint.id,
        tenant=endpoint.tenant,
        isolated=queues.isolation(state, endpoint),
    )


def _warn_in_headers(response: Response, warnings: list[str]) -> None:
    for warning in warnings:
        response.headers.append("hookline-warning", warning)


def _pattern_warnings(catalog: Catalog, endpoint: StoredEndpoint) -> list[str]:
    """Patterns that match no type of the event-type catalog (a typo, most likely): said, not refused."""
    unknown = catalog.unknown_patterns(endpoint.event_types)
    if unknown:
        log.warning("endpoint_pattern_unknown", endpoint_id=endpoint.id, patterns=unknown)
    return [
        f"event_types pattern {pattern!r} matches no type in the event-type catalog" for pattern in unknown
    ]


@router.get("", response_model=EndpointList)
async def list_endpoints(
    registry: Registry,
    caller: Caller,
    tenant: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[
        str | None, Query(max_length=64, description="return endpoints created after this id")
    ] = None,
) -> EndpointList:
    tenant = caller.scope(tenant)
    # Ids are ULIDs, so id order is creation order and makes `after` a stable cursor.
    selected = registry.rows.page(tenant=tenant, after=after, limit=limit + 1)
    page = selected[:limit]
    return EndpointList(
        data=[endpoint.public() for endpoint in page if caller.sees_endpoint(endpoint.id)],
        next_after=page[-1].id if len(selected) > limit else None,
    )


@router.get("/{endpoint_id}", response_model=Endpoint)
async def get_endpoint(endpoint_id: str, registry: Registry, caller: Caller, response: Response) -> Endpoint:
    endpoint = caller.endpoint(registry, endpoint_id)
    _etag(response, endpoint)
    return endpoint.public()


@router.get("/{endpoint_id}/secret", response_model=EndpointSecret)
async def get_secret(endpoint_id: str, state: State, caller: Caller) -> EndpointSecret:
    endpoint = caller.endpoint(state.registry, endpoint_id)
    notifier_id = notifications.notifier_of(endpoint)
    notifier = state.registry.get(notifier_id) if notifier_id else None
    return EndpointSecret(
        secret=state.sealer.open(endpoint.secrets[0].value),
        notify_secret=state.sealer.open(notifier.secrets[0].value) if notifier else None,
    )


@router.patch("/{endpoint_id}", response_model=Endpoint)
async def update_endpoint(
    endpoint_id: str,
    change: EndpointUpdate,
    state: State,
    caller: Caller,
    response: Response,
    if_match: IfMatch = None,
) -> Endpoint:
    before = caller.endpoint(state.registry, endpoint_id)
    _may_skip_verification(caller, verify=change.verify)
    base_version = writes.base_version(before, if_match)
    after, changes = await _changed_to(state, before, change)
    if after.url != before.url and change.verify:
        after = await _handshake(state, after)
    if before.straight and not after.ordered:
        back = {"straight": False, "laned": True, "lane_fence": None, "left_lane_at": None}
        after = after.model_copy(update=back)  # back on its lane
    elif after.ordered and not before.ordered and before.laned:
        # Leaving its lane: its queue bound to events as it is declared (below), its lane's fence after.
        after = after.model_copy(update={"straight": True, "lane_fence": new_id("fence")})
    moving = after.single_consumer != before.single_consumer
    after = await queues.queues_for(state, before, after, moving=moving)
    try:
        written = await writes.write(state, after, base_version)
    except ApiError:
        await queues.undo(state.broker, before, after, moving=moving)
        raise
    if moving:
        log.info(
            "endpoint_queue_moved",
            endpoint_id=endpoint_id,
            from_queue=topology.endpoint_queue(before.id, before.queue_generation),
            to_queue=topology.endpoint_queue(written.id, written.queue_generation),
            isolated=queues.isolation(state, written),
        )
    new_patterns = sorted(set(written.event_types) - set(before.event_types))
    if before.straight and not written.straight:
        new_patterns = written.event_types  # its lane bound for them all, then its queue unbound
    if new_patterns:
        await queues.activate(state, written, patterns=new_patterns)
    elif moving:
        # Its limits hold from the answer on: every live dispatcher hands its parts to the new queue by
        # then (one still reading the change would deliver an event published after it from the lane).
        await queues.applied_everywhere(state, [endpoint_id])
    if before.straight:
        await queues.unbind_straight(state, before, written)
    if written.lane_fence is not None and written.lane_fence != before.lane_fence:
        written = await queues.leave_lane(state, written)
    log.info("endpoint_updated", endpoint_id=endpoint_id, tenant=written.tenant, fields=sorted(changes))
    await _audit(state.trail, caller, "endpoint.updated", before, written)
    _etag(response, written)
    _warn_in_headers(
        response, _pattern_warnings(state.change_log.catalog, written) if "event_types" in changes else []
    )
    return written.public()


async def _changed_to(
    state: IngestState, before: StoredEndpoint, change: EndpointUpdate
) -> tuple[StoredEndpoint, dict[str, Any]]:
    """The endpoint as the fields the request set leave it, checked, its credentials sealed, its
    notifier registered (not written yet); and those fields, as stored."""
    changes = change.model_dump(exclude_unset=True, exclude={"verify"})
    if before.polling and (pushing := sorted(set(changes) - POLLING_FIELDS)):
        raise writes.invalid(pushing[0], "a polling endpoint takes none: nothing is pushed to it")
    for field in ("url", "event_types", "ordered", "body_format", "notify_format"):
        if field in changes and changes[field] is None:
            raise writes.invalid(field, "must not be null")
    if "url" in changes:
        await writes.check_target(changes["url"], state.settings)
    changes |= await writes.endpoint_credentials(state, changes, change)
    # A combination the model refuses is a 422 naming the fields (the app's ValidationError handler).
    after = StoredEndpoint.model_validate({**before.model_dump(), **changes, "updated_at": datetime.now(UTC)})
    if "notify_url" in changes or notifications.notifier_of(after) != notifications.notifier_of(before):
        await notifiers.notifier(state, after)  # new, or named again (a disabled one resumes)
    return after, changes


@router.post("/{endpoint_id}/verify", response_model=Endpoint)
async def verify_endpoint(endpoint_id: str, state: State, caller: Caller) -> Endpoint:
    """Run the verification handshake again (after fixing the receiver)."""
    before = caller.endpoint(state.registry, endpoint_id)
    polling.refuse_if_polling(before, "the verification handshake")
    if state.broker.blocked:
        # Its result could not be written: refused before the receiver is called, as every write is.
        raise broker_unavailable("the broker refuses writes for now (a memory or disk alarm)")
    after = await _record_verification(state, before)
    await _audit(state.trail, caller, "endpoint.verified", before, after)
    return after.public()


@router.post("/{endpoint_id}/rotate-secret", response_model=RotatedSecret)
async def rotate_secret(
    endpoint_id: str,
    state: State,
    caller: Caller,
    request: RotateSecret | None = None,
    if_match: IfMatch = None,
) -> RotatedSecret:
    """A new secret signs from now on; the previous one keeps signing too until the overlap ends."""
    before = caller.endpoint(state.registry, endpoint_id)
    base_version = writes.base_version(before, if_match)
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
    written = await writes.write(state, after, base_version)
    log.info("endpoint_secret_rotated", endpoint_id=endpoint_id, tenant=after.tenant, overlap_s=overlap_s)
    await _audit(state.trail, caller, "endpoint.secret_rotated", before, written)
    return RotatedSecret(secret=secret, previous_expires_at=expires_at)


async def _set_status(
    state: IngestState, endpoint_id: str, caller: Caller, status: EndpointStatus, if_match: str | None
) -> Endpoint:
    before = caller.endpoint(state.registry, endpoint_id)
    polling.refuse_if_polling(before, "pausing and resuming deliveries")
    base_version = writes.base_version(before, if_match)
    after = before.model_copy(update={"status": status, "updated_at": datetime.now(UTC)})
    await queues.own_queue_if_isolated(state, before, after)  # paused: its events wait there
    written = await writes.write(state, after, base_version)
    log.info("endpoint_status_changed", endpoint_id=endpoint_id, tenant=after.tenant, status=status.value)
    action = "endpoint.paused" if status is EndpointStatus.PAUSED else "endpoint.resumed"
    await _audit(state.trail, caller, action, before, written)
    return written.public()


@router.post("/{endpoint_id}/pause", response_model=Endpoint)
async def pause_endpoint(
    endpoint_id: str, state: State, caller: Caller, if_match: IfMatch = None
) -> Endpoint:
    """Stop deliveries; events keep queueing for the endpoint and nothing is attempted."""
    return await _set_status(state, endpoint_id, caller, EndpointStatus.PAUSED, if_match)


@router.post("/{endpoint_id}/resume", response_model=Endpoint)
async def resume_endpoint(
    endpoint_id: str, state: State, caller: Caller, if_match: IfMatch = None
) -> Endpoint:
    """Deliver again, a paused endpoint or one disabled after a 410: what queued meanwhile goes out."""
    return await _set_status(state, endpoint_id, caller, EndpointStatus.ACTIVE, if_match)


@router.delete("/{endpoint_id}", status_code=204)
async def delete_endpoint(
    endpoint_id: str,
    state: State,
    caller: Caller,
    force: Annotated[
        bool, Query(description="delete even with events pending; they become dead letters")
    ] = False,
    if_match: IfMatch = None,
) -> Response:
    endpoint = caller.endpoint(state.registry, endpoint_id)
    base_version = writes.base_version(endpoint, if_match)
    ready = await queues.ready_messages(state, endpoint)
    unacked = await queues.held_by_dispatchers(state, endpoint.id)
    if (ready or unacked) and not force:
        raise ApiError(
            409,
            "events_pending",
            f"{ready} events are queued and {unacked} being delivered for this endpoint; "
            "delete with ?force=true to dead-letter them",
        )
    route = state.registry.placements.direct(endpoint)
    # 1. The deletion, conditional like every change: from here on every dispatcher drains the
    #    endpoint's queues into endpoint_gone dead letters, including whatever comes back to them late
    #    (a nack, a crashed handler, a dispatcher that lost its channel); the monitor removes the
    #    queues once they have stayed empty for a while.
    record = EndpointDeleted(
        change_id=new_id("chg"), at=datetime.now(UTC), endpoint_id=endpoint_id, base_version=base_version
    )
    try:
        await state.change_log.write(record, timeout_s=state.settings.registry_wait_s)
    except StaleWriteError as exc:
        raise writes.changed(exc.current) from None
    # 2. A fence in its lane, behind every event published before the deletion: until a dispatcher takes
    #    it, the fan-out still counts the endpoint and keeps its copies as endpoint_gone dead letters, so
    #    nothing published before the deletion is lost; after it, nothing reaches the endpoint. What is
    #    addressed to it (a retry on its way) becomes an endpoint_gone dead letter; a pattern no other
    #    endpoint needs is unbound by the leading monitor. An endpoint of the version before lanes loses
    #    its route exchanges.
    if route is not None:
        # Its queue of its own bound to events directly: no longer (what came in meanwhile is drained
        # into dead letters like the rest), before the fence, so that nothing published after the fence
        # has passed reaches it either.
        async with state.broker.channel() as admin:
            await topology.unbind_direct(admin, route.queue, endpoint.tenant, route.patterns)
    if endpoint.straight:
        # Its queue of its own bound to events: no longer (nothing of it is in its lane, unless it was
        # leaving it: then the fence too).
        async with state.broker.channel() as admin:
            await topology.unbind_direct(
                admin, topology.own_queue(endpoint), endpoint.tenant, endpoint.event_types
            )
    if endpoint.laned:
        await queues.fence(state, endpoint)
    elif not endpoint.straight:
        async with state.broker.channel() as admin:
            await topology.unroute_legacy(admin, endpoint)
    log.info(
        "endpoint_deleted", endpoint_id=endpoint_id, tenant=endpoint.tenant, ready=ready, unacked=unacked
    )
    await state.trail.record(
        caller, "endpoint.deleted", tenant=endpoint.tenant, target=endpoint_id,
        changes={"url": audit.redact_url(endpoint.url) if endpoint.url else None, "force": force, "events_dead_lettered": ready + unacked if force else 0},
    )  # fmt: skip
    return Response(status_code=204)
