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
import contextlib
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import orjson
import structlog
from fastapi import APIRouter, Header, Query, Response
from pydantic import ValidationError

from hookline.ingest import audit, polling
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
from hookline.ingest.settings import IngestSettings
from hookline.ingest.state import IngestState, Registry, State
from hookline.ingest.verification import verify
from hookline.shared.broker import placement, topology
from hookline.shared.broker.amqp import Broker, QueueProbe
from hookline.shared.broker.capacity import QUORUM_QUEUE_FILE_HANDLES
from hookline.shared.broker.streams import Record, read_until_now
from hookline.shared.contracts import addressing
from hookline.shared.contracts.headers import Header as Headers
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import (
    Endpoint,
    EndpointDeleted,
    EndpointStatus,
    ErrorDetail,
    MtlsAuth,
    OAuth2ClientCredentials,
    SigningSecret,
    StoredEndpoint,
)
from hookline.shared.contracts.telemetry import Heartbeat, batch
from hookline.shared.outbound import credentials
from hookline.shared.outbound.signing import generate_secret
from hookline.shared.outbound.targets import registration_refusal
from hookline.shared.runtime.api import ApiError, broker_unavailable, invalid_input
from hookline.shared.state import notifications
from hookline.shared.state.catalog import Catalog
from hookline.shared.state.changefold import Stale
from hookline.shared.state.registry import StaleWriteError

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/v1/endpoints", tags=["endpoints"])

# A reading of the broker's file handles this recent is good enough to let one more queue in.
CAPACITY_MAX_AGE_S = 5.0
CAPACITY_RETRY_AFTER_S = 60
IfMatch = Annotated[
    str | None,
    Header(description="the endpoint version (its ETag) this change is based on; 409 if it is not current"),
]

#: Endpoints of one batch prepared at once (each its checks and handshake); all then written in one record.
BATCH_CONCURRENCY = 64
#: How long a PATCH that makes a laned endpoint ordered waits for its lane to pass the fence.
LEAVE_LANE_WAIT_S = 2.0
#: How far back the delete check looks for dispatcher heartbeats (they come every 5 s).
_HEARTBEAT_LOOKBACK = timedelta(seconds=12)


def _invalid(field: str, message: str) -> ApiError:
    return ApiError(
        422, "invalid_fields", f"invalid value for: {field}", [ErrorDetail(field=field, message=message)]
    )


async def _check_target(url: str, settings: IngestSettings, field: str = "url") -> None:
    """Refuse, naming the reason, a URL hookline would not call (scheme, private or reserved addresses)."""
    refusal = await registration_refusal(
        url, allow_http=settings.allow_http, allow_private=settings.allow_private_targets
    )
    if refusal is not None:
        raise _invalid(field, refusal)


async def _credentials(
    state: IngestState, fields: dict[str, Any], given: EndpointCreate | EndpointUpdate
) -> dict[str, Any]:
    """The stored form of the headers and auth in ``fields`` (those present), checked and sealed."""
    stored: dict[str, Any] = {}
    if "headers" in fields:
        stored |= credentials.stored_headers(state.sealer, given.headers)
    if "auth" in fields:
        auth = given.auth
        if isinstance(auth, OAuth2ClientCredentials):
            await _check_target(auth.token_url, state.settings, "auth.token_url")
        if isinstance(auth, MtlsAuth) and (problem := credentials.certificate_problem(auth)) is not None:
            raise _invalid("auth", problem)
        stored |= credentials.stored_auth(state.sealer, auth)
    return stored


async def _notifier(state: IngestState, endpoint: StoredEndpoint) -> StoredEndpoint | None:
    """The notifier that delivers ``endpoint``'s notifications (notifications.py): registered in the
    operator tenant the first time a tenant names that URL and format, shared after that; one that was
    disabled (a 410, a breaker open too long) is resumed, since the tenant names the URL again."""
    notifier_id = notifications.notifier_of(endpoint)
    if notifier_id is None or endpoint.notify_url is None:
        return None
    if (existing := state.registry.get(notifier_id)) is not None:
        return await _resumed(state, existing) if existing.status is EndpointStatus.DISABLED else existing
    await _check_target(endpoint.notify_url, state.settings, "notify_url")
    now = datetime.now(UTC)
    notifier = StoredEndpoint(
        id=notifier_id,
        tenant=notifications.OPERATOR_TENANT,
        url=endpoint.notify_url,
        event_types=[notifications.NOTIFIER_EVENT_TYPE],
        description=f"notifications for tenant {endpoint.tenant}",
        body_format=endpoint.notify_format,
        # No handshake: a notifier carries only hookline's own operational facts, and a Slack hook
        # would refuse the handshake's body.
        verified=True,
        created_at=now,
        updated_at=now,
        secrets=[SigningSecret(value=state.sealer.seal(generate_secret()), created_at=now)],
        routed=True,
        laned=True,
    )
    try:
        written = await _write(state, notifier, base_version=0)
    except ApiError:
        if (current := state.registry.get(notifier_id)) is None:
            raise
        return current  # another replica registered the same notifier first: one is enough
    # Notifications are addressed to it, never published to events: no pattern to bind.
    await _activate(state, written, patterns=[])
    log.info("notifier_created", endpoint_id=notifier_id, for_tenant=endpoint.tenant)
    return written


async def _resumed(state: IngestState, notifier: StoredEndpoint) -> StoredEndpoint | None:
    def resumed(current: StoredEndpoint) -> StoredEndpoint | None:
        if current.status is not EndpointStatus.DISABLED:
            return None  # resumed meanwhile (or paused by an admin: left so)
        return current.model_copy(update={"status": EndpointStatus.ACTIVE, "updated_at": datetime.now(UTC)})

    written = await state.change_log.update(notifier.id, resumed, timeout_s=state.settings.registry_wait_s)
    if written is not None:
        log.info("notifier_resumed", endpoint_id=notifier.id)
    return state.registry.get(notifier.id)


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
        raise _invalid("tenant", f"{tenant!r} is reserved for hookline's own notifications")


def _base_version(endpoint: StoredEndpoint, if_match: str | None) -> int:
    """The version a change is based on: the caller's ``If-Match`` (``"3"``, ``3`` or ``W/"3"``), or the
    version this request read."""
    if if_match is None:
        return endpoint.version
    text = if_match.strip().removeprefix("W/").strip('"')
    if not text.isascii() or not text.isdigit():
        raise ApiError(400, "invalid_if_match", "If-Match must be an endpoint version, as in its ETag")
    if int(text) != endpoint.version:
        raise _changed(endpoint)
    return endpoint.version


def _changed(current: StoredEndpoint | None) -> ApiError:
    if current is None:
        return ApiError(404, "not_found", "the endpoint was deleted meanwhile")
    return ApiError(
        409,
        "endpoint_changed",
        f"the endpoint changed meanwhile (now at version {current.version}); read it again and retry",
    )


async def _write(state: IngestState, endpoint: StoredEndpoint, base_version: int) -> StoredEndpoint:
    try:
        return await state.change_log.upsert(
            endpoint, base_version=base_version, timeout_s=state.settings.registry_wait_s
        )
    except StaleWriteError as exc:
        raise _changed(exc.current) from None


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


def _isolation(state: IngestState, endpoint: StoredEndpoint) -> str | None:
    return placement.reason(endpoint, state.registry.placements.placement(endpoint.id))


async def _own_queue_if_isolated(
    state: IngestState, before: StoredEndpoint | None, after: StoredEndpoint
) -> None:
    """Before ``after`` is written: its queue of its own, when it will be isolated (its options, status
    or verification need one, or it has one already for another reason) and the broker has room; held
    past the bound (a holding lane), none."""
    if _isolation(state, after) is None or state.registry.placements.held(after):
        return
    if (
        before is None
        or not state.registry.placements.has_queue(before.id)
        or before.queue_generation != after.queue_generation
    ):
        await _check_capacity(state)
    if after.straight and after.laned and not (before is not None and before.straight):
        # Starting to leave its lane: bound to events only once every dispatcher knows (_leave_lane), so
        # that no replica still delivers its lane copies inline while the broker puts the same events in
        # its queue.
        after = after.model_copy(update={"straight": False})
    async with state.broker.channel() as admin:
        await topology.declare_own_queue(admin, after)


async def _activate(state: IngestState, endpoint: StoredEndpoint, *, patterns: list[str]) -> None:
    """Once the endpoint's record is written: wait until every live dispatcher has applied it, then bind
    its lane for ``patterns`` (those this ingest has not bound: binding is idempotent), if it is laned
    (a ``straight`` endpoint's queue was bound for them as it was declared)."""
    await _applied_everywhere(state, [endpoint.id])
    if endpoint.on_lane:
        await _bind(state, {endpoint.tenant: patterns})


async def _activate_all(state: IngestState, endpoints: list[StoredEndpoint]) -> None:
    """``_activate`` for a batch: one wait for the last record, each tenant's patterns bound once."""
    await _applied_everywhere(state, [endpoint.id for endpoint in endpoints])
    patterns: dict[str, list[str]] = {}
    for endpoint in filter(lambda endpoint: endpoint.on_lane, endpoints):
        patterns.setdefault(endpoint.tenant, []).extend(endpoint.event_types)
    await _bind(state, {tenant: sorted(set(named)) for tenant, named in patterns.items()})


async def _applied_everywhere(state: IngestState, endpoint_ids: list[str]) -> None:
    offset = state.change_log.applied_offset  # at or past the records just written (read back)
    if offset is None:
        return
    lagging = await state.replicas.applied(offset, timeout_s=state.settings.registry_wait_s)
    if lagging:
        # Not waited for longer: each follows the change log live and catches up on its own.
        log.warning("endpoint_activation_late", endpoint_ids=endpoint_ids[:10], dispatchers=lagging)


async def _bind(state: IngestState, patterns: dict[str, list[str]]) -> None:
    unbound = {tenant: state.bound.unbound(tenant, named) for tenant, named in patterns.items()}
    unbound = {tenant: named for tenant, named in unbound.items() if named}
    if not unbound:
        return
    async with state.broker.channel() as admin:
        for tenant, named in unbound.items():
            await topology.bind_patterns(admin, tenant, named)
            state.bound.bound(tenant, named)


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
    await _activate(state, created.endpoint, patterns=created.endpoint.event_types)
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
                outcome = EndpointBatchItem.refused(index, _changed(endpoint.current))
            else:
                created.append(_answer(state, outcome, endpoint))
                outcome = EndpointBatchItem(index=index, status=201, endpoint=created[-1].answer)
        results.append(outcome)
    if created:
        await _activate_all(state, [c.endpoint for c in created])
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
    """An endpoint prepared and written; not answered for yet (``_activate``)."""
    prepared = await _prepare(state, caller, spec)
    return _answer(state, prepared, await _write(state, prepared.endpoint, base_version=0))


async def _prepare(state: IngestState, caller: Caller, spec: EndpointCreate) -> _Prepared:
    """An endpoint checked, handshaken (unless skipped), with its notifier registered and its queue of
    its own if it needs one; not written yet."""
    caller.require(spec.tenant)
    polls = spec.kind == "polling"  # nothing is sent to it: no target to check, no handshake
    _may_skip_verification(caller, verify=spec.verify or polls)
    _reserved(spec.tenant)
    state.quotas.check_endpoints(spec.tenant)
    if spec.url is not None:
        await _check_target(spec.url, state.settings)
    now = datetime.now(UTC)
    secret = generate_secret()
    poll_token = polling.new_token() if polls else None
    sealed = await _credentials(state, {"headers": None, "auth": None}, spec)
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
    notifier = await _notifier(state, endpoint)
    if spec.verify and not polls:
        endpoint = await _handshake(state, endpoint)
    await _own_queue_if_isolated(state, None, endpoint)
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
        isolated=_isolation(state, endpoint),
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
    base_version = _base_version(before, if_match)
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
    after = await _queues_for(state, before, after, moving=moving)
    try:
        written = await _write(state, after, base_version)
    except ApiError:
        await _undo(state.broker, before, after, moving=moving)
        raise
    if moving:
        log.info(
            "endpoint_queue_moved",
            endpoint_id=endpoint_id,
            from_queue=topology.endpoint_queue(before.id, before.queue_generation),
            to_queue=topology.endpoint_queue(written.id, written.queue_generation),
            isolated=_isolation(state, written),
        )
    new_patterns = sorted(set(written.event_types) - set(before.event_types))
    if before.straight and not written.straight:
        new_patterns = written.event_types  # its lane bound for them all, then its queue unbound
    if new_patterns:
        await _activate(state, written, patterns=new_patterns)
    if before.straight:
        await _unbind_straight(state, before, written)
    if written.lane_fence is not None and written.lane_fence != before.lane_fence:
        written = await _leave_lane(state, written)
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
        raise _invalid(pushing[0], "a polling endpoint takes none: nothing is pushed to it")
    for field in ("url", "event_types", "ordered", "body_format", "notify_format"):
        if field in changes and changes[field] is None:
            raise _invalid(field, "must not be null")
    if "url" in changes:
        await _check_target(changes["url"], state.settings)
    changes |= await _credentials(state, changes, change)
    # A combination the model refuses is a 422 naming the fields (the app's ValidationError handler).
    after = StoredEndpoint.model_validate({**before.model_dump(), **changes, "updated_at": datetime.now(UTC)})
    if "notify_url" in changes or notifications.notifier_of(after) != notifications.notifier_of(before):
        await _notifier(state, after)  # new, or named again (a disabled one resumes)
    return after, changes


async def _queues_for(
    state: IngestState, before: StoredEndpoint, after: StoredEndpoint, *, moving: bool
) -> StoredEndpoint:
    """The queue ``after`` needs, declared before its record is written (``_undo`` deletes it if the
    write loses): when ``moving`` (the options that shape a queue changed), ``after`` names a queue of the
    next generation, and the one it had goes to ``retired_queues`` to be drained into its address."""
    if moving:
        retired = await _live_queues(state.broker, before.retired_queues)
        if state.registry.placements.has_queue(before.id):
            retired.append(topology.own_queue(before))
        after = after.model_copy(
            update={"queue_generation": before.queue_generation + 1, "retired_queues": retired}
        )
    await _own_queue_if_isolated(state, before, after)
    return after


async def _undo(broker: Broker, before: StoredEndpoint, after: StoredEndpoint, *, moving: bool) -> None:
    """A change that lost to another write: a queue of the next generation declared for it (empty, known
    to nobody) is deleted. (One of the same generation is the endpoint's own already: kept, without the
    bindings the change gave it.)"""
    async with broker.channel() as admin:
        if moving:
            await admin.queue_delete(topology.own_queue(after))
        elif after.straight:
            added = set(after.event_types) - set(before.event_types)
            await topology.unbind_direct(admin, topology.own_queue(after), after.tenant, added)


async def _leave_lane(
    state: IngestState, endpoint: StoredEndpoint, *, wait_s: float = LEAVE_LANE_WAIT_S
) -> StoredEndpoint:
    """An endpoint written leaving its lane (made ordered: ``StoredEndpoint.lane_fence``). Once every
    live dispatcher has applied that record (each then hands its lane copies on to its queue as second
    copies, skipped where the event came straight too), its queue is bound to ``events``; then its
    fence goes in its lane, behind every lane message published before that binding, and the
    dispatcher that takes it writes it off its lane. The endpoint as it then is, if that comes within
    ``wait_s`` (a lane that holds a backlog takes longer: its version moves once more a while later)."""
    await _applied_everywhere(state, [endpoint.id])
    async with state.broker.channel() as admin:
        await topology.declare_own_queue(admin, endpoint)
    await _fence(state, endpoint, fence_id=endpoint.lane_fence, version=endpoint.version)
    deadline_s = time.monotonic() + wait_s
    while time.monotonic() < deadline_s:
        current = state.registry.get(endpoint.id)
        if current is None or current.version != endpoint.version:
            return current or endpoint
        await asyncio.sleep(0.02)
    if wait_s:
        log.info("endpoint_leaving_lane", endpoint_id=endpoint.id, waited_s=wait_s)
    return endpoint


async def _fence(
    state: IngestState, endpoint: StoredEndpoint, *, fence_id: str | None = None, version: int | None = None
) -> None:
    """A fence in the endpoint's lane (``dispatcher/fences.py``), for its deletion or, with the version
    that wrote it, for its leaving the lane."""
    headers: dict[str, object] = {Headers.FENCE: endpoint.id}
    if version is not None:
        headers[Headers.FENCE_VERSION] = version
    fence = addressing.message(
        b"", event_id=fence_id or new_id("fence"), endpoint_id=endpoint.id, headers=headers
    )
    await addressing.send(state.publisher, fence, destination=topology.lane_of(endpoint.tenant))


async def _unbind_straight(state: IngestState, before: StoredEndpoint, after: StoredEndpoint) -> None:
    """Once ``after`` is written (and, back on its lane, its lane bound): the patterns ``before``'s queue
    was bound to ``events`` for that ``after`` does not have it bound for, unbound. An event published
    meanwhile may have come both ways (a duplicate), none neither way."""
    # Straight it keeps its queue: a queue of the next generation comes only with ``ordered`` removed.
    dropped = set(before.event_types) - (set(after.event_types) if after.straight else set())
    if dropped:
        async with state.broker.channel() as admin:
            await topology.unbind_direct(admin, topology.own_queue(before), before.tenant, dropped)


async def _check_capacity(state: IngestState) -> None:
    """Before a queue of its own: the broker must take the write that follows it, and have file handles
    for it (RabbitMQ 3.x accounts three for every quorum queue; with its account full it stops accepting
    connections without a word), and the endpoints with one must be fewer than
    ``HOOKLINE_MAX_ENDPOINT_QUEUES``. Refused before anything is declared, so nothing is left behind."""
    if state.registry.placements.queued_count >= state.settings.max_endpoint_queues:
        raise ApiError(
            503,
            "isolation_capacity",
            f"{state.registry.placements.queued_count} endpoints have a queue of their own, the most allowed "
            f"(HOOKLINE_MAX_ENDPOINT_QUEUES={state.settings.max_endpoint_queues}); this endpoint needs one "
            "(a rate limit, max_in_flight, ordered, paused, or not verified)",
            headers={"Retry-After": str(CAPACITY_RETRY_AFTER_S)},
        )
    capacity = await state.capacity.recent(max_age_s=CAPACITY_MAX_AGE_S)
    if not state.broker.blocked and capacity is not None and (capacity.memory_alarm or capacity.disk_alarm):
        # The alarm in a reading up to a few seconds old, while the broker takes our writes: it may have
        # cleared since (a new endpoint was refused for seconds after an alarm ended). Read again.
        capacity = await state.capacity.recent(max_age_s=0)
    if state.broker.blocked or (capacity is not None and (capacity.memory_alarm or capacity.disk_alarm)):
        raise broker_unavailable("the broker refuses writes for now (a memory or disk alarm)")
    headroom = capacity.fd_headroom if capacity is not None else None
    needed = state.settings.broker_fd_reserve + QUORUM_QUEUE_FILE_HANDLES
    if capacity is not None and headroom is not None and headroom < needed:
        log.error("broker_capacity_refused", fd_used=capacity.fd_used, fd_limit=capacity.fd_limit, alert=True)
        raise ApiError(
            503,
            "broker_capacity",
            f"the broker has {headroom} of {capacity.fd_limit} file handles left and keeps "
            f"{state.settings.broker_fd_reserve} (HOOKLINE_BROKER_FD_RESERVE) for connections; an endpoint's "
            f"queue of its own needs {QUORUM_QUEUE_FILE_HANDLES}: raise the broker's file limit (ulimit -n)",
            headers={"Retry-After": str(CAPACITY_RETRY_AFTER_S)},
        )


async def _live_queues(broker: Broker, queues: list[str]) -> list[str]:
    """The queues that still exist (retired queues are removed by the monitor once drained)."""
    async with QueueProbe(broker) as probe:
        return [name for name in queues if await probe.find(name) is not None]


async def settle(state: IngestState, endpoint_id: str) -> None:
    """At start, once, for an endpoint not settled on its lane (``EndpointRegistry.to_settle``): one of
    a version before lanes is moved onto its lane (:func:`_upgrade`); an ordered one still laned (of the
    version before straight endpoints) leaves it (:func:`_straighten`); one leaving its lane gets its
    binding and its fence again (an ingest may have stopped before it had made them; a fence that comes
    twice is dropped the second time)."""
    endpoint = state.registry.get(endpoint_id)
    if endpoint is None:
        return
    if endpoint.straight and endpoint.laned:
        await _leave_lane(state, endpoint, wait_s=0)
    elif endpoint.ordered and endpoint.laned and not endpoint.straight:
        await _straighten(state, endpoint)
    elif not endpoint.laned and not endpoint.straight:
        await _upgrade(state, endpoint)


async def _straighten(state: IngestState, endpoint: StoredEndpoint) -> None:
    """An ordered endpoint on its lane (a queue of its own, its lane copies handed on to it) leaves it as
    a PATCH that sets ``ordered`` makes it (:func:`_leave_lane`); a change written meanwhile wins."""
    update = {"straight": True, "lane_fence": new_id("fence")}

    def leaving(current: StoredEndpoint) -> StoredEndpoint | None:
        unchanged = current.version == endpoint.version
        return current.model_copy(update=update) if unchanged else None

    written = await state.change_log.update(endpoint.id, leaving, timeout_s=state.settings.registry_wait_s)
    if written is not None:
        await _leave_lane(state, written, wait_s=0)
        log.info("endpoint_upgraded", endpoint_id=endpoint.id, to="straight")


async def _upgrade(state: IngestState, endpoint: StoredEndpoint) -> None:
    """Move an endpoint of a version before lanes onto its lane: its patterns bound on the lane first
    (the fan-out passes it over until its record says it is laned: no event reaches it twice, but for
    the moment between that record and its route exchanges' removal), then the record, its old queue
    among those to drain; then its route exchanges go. Retries still addressed to them come back
    unroutable and are forwarded to its address."""
    endpoint_id = endpoint.id
    async with state.broker.channel() as admin:
        await topology.bind_patterns(admin, endpoint.tenant, endpoint.event_types)

    def laned(current: StoredEndpoint) -> StoredEndpoint | None:
        if current.laned:
            return None
        return current.model_copy(
            update={
                "laned": True,
                "routed": True,
                "queue_generation": current.queue_generation + 1,
                "retired_queues": [*current.retired_queues, topology.own_queue(current)][-100:],
            }
        )

    after = laned(endpoint)
    assert after is not None
    await _own_queue_if_isolated(state, endpoint, after)
    await state.change_log.update(endpoint_id, laned, timeout_s=state.settings.registry_wait_s)
    async with state.broker.channel() as admin:
        await topology.unroute_legacy(admin, endpoint)
    log.info("endpoint_upgraded", endpoint_id=endpoint_id, to="lane")


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
    base_version = _base_version(before, if_match)
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
    written = await _write(state, after, base_version)
    log.info("endpoint_secret_rotated", endpoint_id=endpoint_id, tenant=after.tenant, overlap_s=overlap_s)
    await _audit(state.trail, caller, "endpoint.secret_rotated", before, written)
    return RotatedSecret(secret=secret, previous_expires_at=expires_at)


async def _set_status(
    state: IngestState, endpoint_id: str, caller: Caller, status: EndpointStatus, if_match: str | None
) -> Endpoint:
    before = caller.endpoint(state.registry, endpoint_id)
    polling.refuse_if_polling(before, "pausing and resuming deliveries")
    base_version = _base_version(before, if_match)
    after = before.model_copy(update={"status": status, "updated_at": datetime.now(UTC)})
    await _own_queue_if_isolated(state, before, after)  # paused: its events wait there
    written = await _write(state, after, base_version)
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
    base_version = _base_version(endpoint, if_match)
    ready = await _ready_messages(state, endpoint)
    unacked = await _held_by_dispatchers(state, endpoint.id)
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
        raise _changed(exc.current) from None
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
        await _fence(state, endpoint)
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


async def _ready_messages(state: IngestState, endpoint: StoredEndpoint) -> int:
    """Messages waiting in the endpoint's queues of its own (none without one: what is on its way to it
    from its lane is counted by the dispatchers, in their heartbeats)."""
    names = [*endpoint.retired_queues]
    if state.registry.placements.has_queue(endpoint.id):
        names.append(topology.own_queue(endpoint))
    async with QueueProbe(state.broker) as probe:
        return sum([await probe.depth(name) or 0 for name in names])


async def _held_by_dispatchers(state: IngestState, endpoint_id: str) -> int:
    """Messages of the endpoint that dispatchers hold unacked, from their last heartbeats (a queue's
    ready count leaves them out). At most a heartbeat interval old: a delivery that started since is
    not counted."""
    latest: dict[str, Heartbeat] = {}

    def collect(message: Record) -> None:
        with contextlib.suppress(ValidationError, orjson.JSONDecodeError):
            for record in batch.validate_json(message.body):
                if isinstance(record, Heartbeat):
                    latest[record.dispatcher_id] = record

    await read_until_now(
        state.broker,
        state.publisher,
        topology.TELEMETRY_LOG,
        collect,
        start=datetime.now(UTC) - _HEARTBEAT_LOOKBACK,
        timeout_s=state.settings.registry_wait_s,
    )
    recent_s = time.time() - _HEARTBEAT_LOOKBACK.total_seconds()
    return sum(beat.unacked.get(endpoint_id, 0) for beat in latest.values() if beat.at_s >= recent_s)
