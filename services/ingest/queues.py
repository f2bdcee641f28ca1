"""An endpoint's place on the broker, as the endpoint routes change it: the patterns its lane is bound
for (bound once every live dispatcher has applied its record), its queue of its own when it needs
isolation (declared before its record is written, so nothing handed to it is lost; refused past the
broker's capacity), leaving its lane for a queue of its own behind a fence, and settling at start what
an earlier version left unsettled."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime, timedelta

import orjson
import structlog
from pydantic import ValidationError

from hookline.ingest.state import IngestState
from hookline.shared.broker import placement, topology
from hookline.shared.broker.amqp import Broker, QueueProbe
from hookline.shared.broker.capacity import QUORUM_QUEUE_FILE_HANDLES
from hookline.shared.broker.streams import Record, read_until_now
from hookline.shared.contracts import addressing
from hookline.shared.contracts.headers import Header as Headers
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import (
    StoredEndpoint,
)
from hookline.shared.contracts.telemetry import Heartbeat, batch
from hookline.shared.runtime.api import ApiError, broker_unavailable

log = structlog.get_logger(__name__)


# A reading of the broker's file handles this recent is good enough to let one more queue in.
CAPACITY_MAX_AGE_S = 5.0


CAPACITY_RETRY_AFTER_S = 60


#: How long a PATCH that makes a laned endpoint ordered waits for its lane to pass the fence.
LEAVE_LANE_WAIT_S = 2.0


#: How far back the delete check looks for dispatcher heartbeats (they come every 5 s).
_HEARTBEAT_LOOKBACK = timedelta(seconds=12)


def isolation(state: IngestState, endpoint: StoredEndpoint) -> str | None:
    return placement.reason(endpoint, state.registry.placements.placement(endpoint.id))


async def own_queue_if_isolated(
    state: IngestState, before: StoredEndpoint | None, after: StoredEndpoint
) -> None:
    """Before ``after`` is written: its queue of its own, when it will be isolated (its options, status
    or verification need one, or it has one already for another reason) and the broker has room; held
    past the bound (a holding lane), none."""
    if isolation(state, after) is None or state.registry.placements.held(after):
        return
    if (
        before is None
        or not state.registry.placements.has_queue(before.id)
        or before.queue_generation != after.queue_generation
    ):
        await check_capacity(state)
    if after.straight and after.laned and not (before is not None and before.straight):
        # Starting to leave its lane: bound to events only once every dispatcher knows (leave_lane), so
        # that no replica still delivers its lane copies inline while the broker puts the same events in
        # its queue.
        after = after.model_copy(update={"straight": False})
    async with state.broker.channel() as admin:
        await topology.declare_own_queue(admin, after)


async def activate(state: IngestState, endpoint: StoredEndpoint, *, patterns: list[str]) -> None:
    """Once the endpoint's record is written: wait until every live dispatcher has applied it, then bind
    its lane for ``patterns`` (those this ingest has not bound: binding is idempotent), if it is laned
    (a ``straight`` endpoint's queue was bound for them as it was declared)."""
    await applied_everywhere(state, [endpoint.id])
    if endpoint.on_lane:
        await bind(state, {endpoint.tenant: patterns})


async def activate_all(state: IngestState, endpoints: list[StoredEndpoint]) -> None:
    """``activate`` for a batch: one wait for the last record, each tenant's patterns bound once."""
    await applied_everywhere(state, [endpoint.id for endpoint in endpoints])
    patterns: dict[str, list[str]] = {}
    for endpoint in filter(lambda endpoint: endpoint.on_lane, endpoints):
        patterns.setdefault(endpoint.tenant, []).extend(endpoint.event_types)
    await bind(state, {tenant: sorted(set(named)) for tenant, named in patterns.items()})


async def applied_everywhere(state: IngestState, endpoint_ids: list[str]) -> None:
    offset = state.change_log.applied_offset  # at or past the records just written (read back)
    if offset is None:
        return
    lagging = await state.replicas.applied(offset, timeout_s=state.settings.registry_wait_s)
    if lagging:
        # Not waited for longer: each follows the change log live and catches up on its own.
        log.warning("endpoint_activation_late", endpoint_ids=endpoint_ids[:10], dispatchers=lagging)


async def bind(state: IngestState, patterns: dict[str, list[str]]) -> None:
    unbound = {tenant: state.bound.unbound(tenant, named) for tenant, named in patterns.items()}
    unbound = {tenant: named for tenant, named in unbound.items() if named}
    if not unbound:
        return
    async with state.broker.channel() as admin:
        for tenant, named in unbound.items():
            await topology.bind_patterns(admin, tenant, named)
            state.bound.bound(tenant, named)


async def queues_for(
    state: IngestState, before: StoredEndpoint, after: StoredEndpoint, *, moving: bool
) -> StoredEndpoint:
    """The queue ``after`` needs, declared before its record is written (``undo`` deletes it if the
    write loses): when ``moving`` (the options that shape a queue changed), ``after`` names a queue of the
    next generation, and the one it had goes to ``retired_queues`` to be drained into its address."""
    if moving:
        retired = await live_queues(state.broker, before.retired_queues)
        if state.registry.placements.has_queue(before.id):
            retired.append(topology.own_queue(before))
        after = after.model_copy(
            update={"queue_generation": before.queue_generation + 1, "retired_queues": retired}
        )
    await own_queue_if_isolated(state, before, after)
    return after


async def undo(broker: Broker, before: StoredEndpoint, after: StoredEndpoint, *, moving: bool) -> None:
    """A change that lost to another write: a queue of the next generation declared for it (empty, known
    to nobody) is deleted. (One of the same generation is the endpoint's own already: kept, without the
    bindings the change gave it.)"""
    async with broker.channel() as admin:
        if moving:
            await admin.queue_delete(topology.own_queue(after))
        elif after.straight:
            added = set(after.event_types) - set(before.event_types)
            await topology.unbind_direct(admin, topology.own_queue(after), after.tenant, added)


async def leave_lane(
    state: IngestState, endpoint: StoredEndpoint, *, wait_s: float = LEAVE_LANE_WAIT_S
) -> StoredEndpoint:
    """An endpoint written leaving its lane (made ordered: ``StoredEndpoint.lane_fence``). Once every
    live dispatcher has applied that record (each then hands its lane copies on to its queue as second
    copies, skipped where the event came straight too), its queue is bound to ``events``; then its
    fence goes in its lane, behind every lane message published before that binding, and the
    dispatcher that takes it writes it off its lane. The endpoint as it then is, if that comes within
    ``wait_s`` (a lane that holds a backlog takes longer: its version moves once more a while later)."""
    await applied_everywhere(state, [endpoint.id])
    async with state.broker.channel() as admin:
        await topology.declare_own_queue(admin, endpoint)
    await fence(state, endpoint, fence_id=endpoint.lane_fence, version=endpoint.version)
    deadline_s = time.monotonic() + wait_s
    while time.monotonic() < deadline_s:
        current = state.registry.get(endpoint.id)
        if current is None or current.version != endpoint.version:
            return current or endpoint
        await asyncio.sleep(0.02)
    if wait_s:
        log.info("endpoint_leaving_lane", endpoint_id=endpoint.id, waited_s=wait_s)
    return endpoint


async def fence(
    state: IngestState, endpoint: StoredEndpoint, *, fence_id: str | None = None, version: int | None = None
) -> None:
    """A fence in the endpoint's lane (``dispatcher/fences.py``), for its deletion or, with the version
    that wrote it, for its leaving the lane."""
    headers: dict[str, object] = {Headers.FENCE: endpoint.id}
    if version is not None:
        headers[Headers.FENCE_VERSION] = version
    message = addressing.message(
        b"", event_id=fence_id or new_id("fence"), endpoint_id=endpoint.id, headers=headers
    )
    await addressing.send(state.publisher, message, destination=topology.lane_of(endpoint.tenant))


async def unbind_straight(state: IngestState, before: StoredEndpoint, after: StoredEndpoint) -> None:
    """Once ``after`` is written (and, back on its lane, its lane bound): the patterns ``before``'s queue
    was bound to ``events`` for that ``after`` does not have it bound for, unbound. An event published
    meanwhile may have come both ways (a duplicate), none neither way."""
    # Straight it keeps its queue: a queue of the next generation comes only with ``ordered`` removed.
    dropped = set(before.event_types) - (set(after.event_types) if after.straight else set())
    if dropped:
        async with state.broker.channel() as admin:
            await topology.unbind_direct(admin, topology.own_queue(before), before.tenant, dropped)


async def check_capacity(state: IngestState) -> None:
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


async def live_queues(broker: Broker, queues: list[str]) -> list[str]:
    """The queues that still exist (retired queues are removed by the monitor once drained)."""
    async with QueueProbe(broker) as probe:
        return [name for name in queues if await probe.find(name) is not None]


async def settle(state: IngestState, endpoint_id: str) -> None:
    """At start, once, for an endpoint not settled on its lane (``EndpointRegistry.to_settle``): one of
    a version before lanes is moved onto its lane (:func:`upgrade`); an ordered one still laned (of the
    version before straight endpoints) leaves it (:func:`straighten`); one leaving its lane gets its
    binding and its fence again (an ingest may have stopped before it had made them; a fence that comes
    twice is dropped the second time)."""
    endpoint = state.registry.get(endpoint_id)
    if endpoint is None:
        return
    if endpoint.straight and endpoint.laned:
        await leave_lane(state, endpoint, wait_s=0)
    elif endpoint.ordered and endpoint.laned and not endpoint.straight:
        await straighten(state, endpoint)
    elif not endpoint.laned and not endpoint.straight:
        await upgrade(state, endpoint)


async def straighten(state: IngestState, endpoint: StoredEndpoint) -> None:
    """An ordered endpoint on its lane (a queue of its own, its lane copies handed on to it) leaves it as
    a PATCH that sets ``ordered`` makes it (:func:`leave_lane`); a change written meanwhile wins."""
    update = {"straight": True, "lane_fence": new_id("fence")}

    def leaving(current: StoredEndpoint) -> StoredEndpoint | None:
        unchanged = current.version == endpoint.version
        return current.model_copy(update=update) if unchanged else None

    written = await state.change_log.update(endpoint.id, leaving, timeout_s=state.settings.registry_wait_s)
    if written is not None:
        await leave_lane(state, written, wait_s=0)
        log.info("endpoint_upgraded", endpoint_id=endpoint.id, to="straight")


async def upgrade(state: IngestState, endpoint: StoredEndpoint) -> None:
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
    await own_queue_if_isolated(state, endpoint, after)
    await state.change_log.update(endpoint_id, laned, timeout_s=state.settings.registry_wait_s)
    async with state.broker.channel() as admin:
        await topology.unroute_legacy(admin, endpoint)
    log.info("endpoint_upgraded", endpoint_id=endpoint_id, to="lane")


async def ready_messages(state: IngestState, endpoint: StoredEndpoint) -> int:
    """Messages waiting in the endpoint's queues of its own (none without one: what is on its way to it
    from its lane is counted by the dispatchers, in their heartbeats)."""
    names = [*endpoint.retired_queues]
    if state.registry.placements.has_queue(endpoint.id):
        names.append(topology.own_queue(endpoint))
    async with QueueProbe(state.broker) as probe:
        return sum([await probe.depth(name) or 0 for name in names])


async def held_by_dispatchers(state: IngestState, endpoint_id: str) -> int:
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
