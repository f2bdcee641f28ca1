"""Endpoint definitions, shared by every replica of every service through a RabbitMQ stream.

The stream ``hookline.endpoints`` is a change log: each record upserts or deletes one endpoint. Every
service replays it from the first offset at start and then follows it live, so a dispatcher started
later (or restarted) knows every endpoint without another database. :class:`EndpointRegistry` is the
in-memory result; :class:`ChangeLog` does the I/O.

Changes are conditional (``base_version``): the stream has no compare-and-set, but every reader applies
records in the same order with the same rule, so a writer learns whether it won by reading its own
record back (:meth:`ChangeLog.write`). A stale write (based on a version that another write replaced
meanwhile) changes nothing: the API answers 409, internal writers re-read and try again
(:meth:`ChangeLog.update`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aio_pika
import structlog
from pydantic import TypeAdapter, ValidationError

from hookline.shared.broker import permissions, placement, topology
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.broker.streams import Record, StreamFollower, follow_synced, offset_of
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import (
    ChangeRecord,
    DirectRoute,
    EndpointDeleted,
    EndpointDrained,
    EndpointStatus,
    EndpointsUpserted,
    EndpointUpserted,
    EventTypeDeleted,
    EventTypeInfo,
    EventTypeUpserted,
    Placement,
    PlacementSet,
    QuotaSet,
    StoredEndpoint,
    StoredToken,
    TenantQuota,
    TokenUpserted,
    error_summary,
)
from hookline.shared.runtime.supervision import Supervisor
from hookline.shared.state import catalog, notifications
from hookline.shared.state.registrystore import RegistryStore
from hookline.shared.state.tenants import Tenants

log = structlog.get_logger(__name__)

_records: TypeAdapter[ChangeRecord] = TypeAdapter(ChangeRecord)
_LEGACY_SYNC = b'{"kind":"sync"'
LOOP = "endpoint-log"
#: The least time between two of :meth:`ChangeLog.caught_up`'s markers: the log keeps every record for
#: ever, and a flood of events refused by a schema must not grow it by hundreds a second.
CAUGHT_UP_EVERY_S = 1.0
#: (tenant, type) pairs whose matching endpoints are remembered; past it the memo starts over.
_MATCHES_KEPT = 100_000
#: Per tenant and event type: the endpoints subscribed, the laned ones among them (the fan-out's), and
#: those that have left their lane (:meth:`EndpointRegistry.left_lane`).
_Matches = tuple[tuple[StoredEndpoint, ...], tuple[StoredEndpoint, ...], tuple[StoredEndpoint, ...]]
#: Parsed endpoints kept by id, and by tenant (their sum): a few KiB each.
CACHED_ENDPOINTS = 10_000
CACHED_TENANT_ENDPOINTS = 20_000
#: What the store's rows mean: a file of another version is built again from the log.
_STORE_VERSION = 1

#: Called with (before, after) for every endpoint that changed; either side is None on create/delete.
Listener = Callable[[StoredEndpoint | None, StoredEndpoint | None], None]


@dataclass(frozen=True, slots=True)
class Stale:
    """A conditional change that lost: the endpoint is at another version (or gone, or exists already)."""

    current: StoredEndpoint | None


class StaleWriteError(Exception):
    def __init__(self, current: StoredEndpoint | None) -> None:
        super().__init__("the endpoint changed meanwhile")
        self.current = current


class StaleEventTypeError(Exception):
    def __init__(self, current: EventTypeInfo | None) -> None:
        super().__init__("the event type changed meanwhile")
        self.current = current


class EndpointRegistry:
    """The endpoints as of the last change-log record applied, with their placements.

    The endpoints themselves are rows of a :class:`~hookline.shared.state.registrystore.RegistryStore` (a
    file, or memory), with the parsed ones a process uses kept in two bounded caches: by id, and by
    tenant (what the fan-out reads: a lane message is matched against its tenant's endpoints). What is
    small stays in memory and is saved with the rows: placements, which endpoints have queues of their
    own, which deleted ones still wait for their fence."""

    def __init__(self, store: RegistryStore | None = None) -> None:
        self.store = store if store is not None else RegistryStore(None, identity="memory")
        if store is None:
            self.store.open()  # in memory: nothing to read, so usable at once (a test, a backup)
        self.store.before_commit = self._save_sets
        self._count = 0
        self._by_id: OrderedDict[str, StoredEndpoint] = OrderedDict()  # parsed, least recently used first
        self._by_tenant: OrderedDict[str, dict[str, StoredEndpoint]] = OrderedDict()
        self._by_tenant_size = 0
        # Deleted endpoints whose lane has not passed the deletion's fence yet, by tenant: the fan-out
        # still counts them, and their copies become endpoint_gone dead letters (not lost).
        self._deleting: dict[str, dict[str, StoredEndpoint]] = {}
        self._deleted_with_queues: set[str] = set()
        self._placements: dict[str, Placement] = {}
        # Endpoints whose queue of their own exists (or may): from the first record that isolates one to
        # the placement that says it was removed. The same for every replica, being the same records in
        # the same order; with those that have queues left to drain, the only endpoints a dispatcher
        # consumes a queue of, or the monitor reads the depth of.
        self._has_queue: set[str] = set()
        self._queued: set[str] = set()
        self._sets_changed = False
        self._matches: dict[str, dict[str, _Matches]] = {}  # tenant -> type -> (subscribed, laned, left)
        self._matches_kept = 0
        self._listeners: list[Listener] = []

    def open(self) -> int | None:
        """Read the store: the offset of the last change-log record it holds (None: build it from the
        first)."""
        offset = self.store.open()
        self._count = self.store.count()
        for body in self.store.kept("placement"):
            placed = Placement.model_validate_json(body)
            self._placements[placed.endpoint_id] = placed
        sets = json.loads(self.store.state("sets") or "{}")
        self._has_queue = set(sets.get("has_queue", ()))
        self._queued = set(sets.get("queued", ()))
        self._deleted_with_queues = set(sets.get("deleted_with_queues", ()))
        for endpoint_id in sets.get("deleting", ()):
            gone = self._deleted(endpoint_id)
            if gone is not None:
                self._deleting.setdefault(gone[0].tenant, {})[endpoint_id] = gone[0]
        return offset

    def close(self) -> None:
        self.store.close()

    def _save_sets(self) -> None:
        if self._sets_changed:
            self._sets_changed = False
            sets = {
                "has_queue": sorted(self._has_queue),
                "queued": sorted(self._queued),
                "deleted_with_queues": sorted(self._deleted_with_queues),
                "deleting": sorted(i for endpoints in self._deleting.values() for i in endpoints),
            }
            self.store.set_state("sets", json.dumps(sets))

    def get(self, endpoint_id: str) -> StoredEndpoint | None:
        found = self._by_id.get(endpoint_id)
        if found is not None:
            self._by_id.move_to_end(endpoint_id)
            return found
        body = self.store.endpoint(endpoint_id)
        if body is None:
            return None
        found = StoredEndpoint.model_validate_json(body)
        self._cache(found)
        return found

    def _cache(self, endpoint: StoredEndpoint) -> None:
        self._by_id[endpoint.id] = endpoint
        self._by_id.move_to_end(endpoint.id)
        while len(self._by_id) > CACHED_ENDPOINTS:
            self._by_id.popitem(last=False)

    def _deleted(self, endpoint_id: str) -> tuple[StoredEndpoint, datetime] | None:
        found = self.store.deleted(endpoint_id)
        if found is None:
            return None
        return StoredEndpoint.model_validate_json(found[0]), datetime.fromtimestamp(found[1], UTC)

    def last_known(self, endpoint_id: str) -> StoredEndpoint | None:
        """The endpoint, or its definition when it was deleted."""
        found = self.get(endpoint_id)
        if found is not None:
            return found
        gone = self._deleted(endpoint_id)
        return gone[0] if gone else None

    def all(self) -> list[StoredEndpoint]:
        """Every endpoint, parsed at once: for what needs them all (a backup, a test); a service walks
        :meth:`every` or asks for what it needs."""
        return list(self.every())

    def every(self, *, unlaned_only: bool = False) -> Iterator[StoredEndpoint]:
        """Every endpoint in id order (or those not moved onto their lane yet), read a batch at a time."""
        for body in self.store.every(unlaned_only=unlaned_only):
            yield StoredEndpoint.model_validate_json(body)

    def page(self, *, tenant: str | None, after: str | None, limit: int) -> list[StoredEndpoint]:
        """Endpoints in id order (creation order: ids are ULIDs) after ``after``."""
        return [
            StoredEndpoint.model_validate_json(body)
            for body in self.store.page(tenant=tenant, after=after, limit=limit)
        ]

    def of_tenant(self, tenant: str) -> list[StoredEndpoint]:
        return list(self._tenant(tenant).values())

    def count_of_tenant(self, tenant: str) -> int:
        cached = self._by_tenant.get(tenant)
        return len(cached) if cached is not None else self.store.count(tenant)

    def _tenant(self, tenant: str) -> dict[str, StoredEndpoint]:
        cached = self._by_tenant.get(tenant)
        if cached is not None:
            self._by_tenant.move_to_end(tenant)
            return cached
        cached = {}
        for body in self.store.of_tenant(tenant):
            endpoint = StoredEndpoint.model_validate_json(body)
            cached[endpoint.id] = self._by_id.get(endpoint.id, endpoint)
        self._by_tenant[tenant] = cached
        self._by_tenant_size += len(cached)
        while self._by_tenant_size > CACHED_TENANT_ENDPOINTS and len(self._by_tenant) > 1:
            evicted, endpoints = self._by_tenant.popitem(last=False)
            self._by_tenant_size -= len(endpoints)
            self._forget_matches(evicted)
        return cached

    def tenants(self) -> list[str]:
        return self.store.tenants()

    def notifier_named(self, notifier_id: str) -> bool:
        """Whether an endpoint names this notifier (:func:`hookline.shared.state.notifications.notifier_of`)."""
        return self.store.named(notifier_id)

    def matching(self, tenant: str, event_type: str) -> tuple[StoredEndpoint, ...]:
        """The tenant's laned endpoints one of whose patterns matches ``event_type``: the fan-out of a lane
        message. An endpoint deleted a moment ago is among them until its lane has passed the deletion's
        fence (its copy is then kept as a dead letter: nothing published before a deletion is lost); an
        endpoint not laned is passed over (its queue of its own is bound to ``events``: ordered, or of
        the version before lanes until the ingest moves it onto its lane), and so is a polling one."""
        return self._subscribed(tenant, event_type)[1]

    def subscribed(self, tenant: str, event_type: str) -> tuple[StoredEndpoint, ...]:
        """The tenant's endpoints one of whose patterns matches ``event_type``, laned or not, polling ones
        too (those deleted whose lane has not passed the fence among them): the delivery log's."""
        return self._subscribed(tenant, event_type)[0]

    def left_lane(self, tenant: str, event_type: str, *, within: timedelta) -> tuple[StoredEndpoint, ...]:
        """The tenant's endpoints one of whose patterns matches ``event_type`` that left their lane at most
        ``within`` ago (made ordered: ``StoredEndpoint.left_lane_at``)."""
        left = self._subscribed(tenant, event_type)[2]
        if not left:
            return ()  # nearly always: no clock read
        since = datetime.now(UTC) - within
        return tuple(e for e in left if e.left_lane_at is not None and e.left_lane_at >= since)

    def _subscribed(self, tenant: str, event_type: str) -> _Matches:
        """Every endpoint subscribed, and the laned ones among them: remembered per tenant and type until
        one of the tenant's endpoints changes, or the tenant leaves the cache."""
        of_tenant = self._matches.get(tenant)
        found = of_tenant.get(event_type) if of_tenant is not None else None
        if found is None:
            every = tuple(
                endpoint
                for endpoints in (self._tenant(tenant), self._deleting.get(tenant, {}))
                for endpoint in endpoints.values()
                if any(topology.topic_matches(pattern, event_type) for pattern in endpoint.event_types)
            )
            found = (
                every,
                tuple(endpoint for endpoint in every if endpoint.on_lane),
                tuple(endpoint for endpoint in every if not endpoint.laned and endpoint.left_lane_at),
            )
            if self._matches_kept >= _MATCHES_KEPT:
                self._matches.clear()
                self._matches_kept = 0
            self._matches.setdefault(tenant, {})[event_type] = found
            self._matches_kept += 1
        return found

    def placement(self, endpoint_id: str) -> Placement | None:
        return self._placements.get(endpoint_id)

    def isolated(self, endpoint: StoredEndpoint) -> bool:
        """Whether the endpoint is delivered from a queue of its own (:mod:`hookline.shared.broker.placement`)."""
        return placement.isolated(endpoint, self._placements.get(endpoint.id))

    def held(self, endpoint: StoredEndpoint) -> bool:
        """Whether the endpoint is isolated in a holding lane (past the bound on queues of their own)."""
        return placement.held(endpoint, self._placements.get(endpoint.id))

    def held_endpoints(self) -> list[StoredEndpoint]:
        """Live endpoints isolated in a holding lane."""
        return [
            endpoint
            for endpoint_id, where in sorted(self._placements.items())
            if where.held and (endpoint := self.get(endpoint_id)) is not None and self.held(endpoint)
        ]

    def address(self, endpoint: StoredEndpoint) -> str:
        """Where a message for this endpoint alone goes now: its queue of its own (or its holding lane),
        or its lane."""
        return topology.address(endpoint, isolated=self.isolated(endpoint), held=self.held(endpoint))

    @property
    def queued_count(self) -> int:
        return len(self._queued)

    def has_queue(self, endpoint_id: str) -> bool:
        """Whether the endpoint's queue of its own (its current generation) exists, or may."""
        return endpoint_id in self._has_queue

    def with_queues(self) -> list[StoredEndpoint]:
        """Live endpoints with a queue of their own, or queues left to drain."""
        return [e for endpoint_id in sorted(self._queued) if (e := self.get(endpoint_id)) is not None]

    def to_settle(self) -> list[StoredEndpoint]:
        """The endpoints whose route the ingest may still have to settle at its start: those not moved
        onto their lane yet, and the ordered ones on it (to leave it, or leaving it: an ordered endpoint
        always has a queue of its own, so they are among the few that have one)."""
        ordered = [endpoint for endpoint in self.with_queues() if endpoint.ordered and endpoint.laned]
        return sorted([*self.every(unlaned_only=True), *ordered], key=lambda endpoint: endpoint.id)

    def deleted_since(self, since: datetime) -> list[StoredEndpoint]:
        """Endpoints deleted at or after ``since``."""
        return [StoredEndpoint.model_validate_json(b) for b, _ in self.store.deleted_since(_seconds(since))]

    def deleted_matching(self, tenant: str, event_type: str, *, since: datetime) -> list[StoredEndpoint]:
        """The tenant's endpoints deleted at or after ``since`` (past their fence) that an event of
        ``event_type`` would have gone to: a lane message given out again (its dispatcher died) may have
        been published before they were deleted, and what it owed them is kept as a dead letter."""
        deleted = (
            StoredEndpoint.model_validate_json(body)
            for body, _ in self.store.deleted_since(_seconds(since), tenant=tenant)
        )
        return [
            endpoint
            for endpoint in deleted
            if endpoint.on_lane
            and any(topology.topic_matches(pattern, event_type) for pattern in endpoint.event_types)
        ]

    def deleted_with_queues_since(self, since: datetime) -> list[StoredEndpoint]:
        """Endpoints deleted at or after ``since`` that had queues of their own (they may still hold
        messages to drain into dead letters)."""
        found = (self._deleted(endpoint_id) for endpoint_id in sorted(self._deleted_with_queues))
        return [gone for gone, at in filter(None, found) if at >= since]

    def __len__(self) -> int:
        return self._count

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def apply(self, record: EndpointUpserted | EndpointDeleted) -> StoredEndpoint | Stale | None:
        """Apply one record: the endpoint as it now is (None once deleted), or :class:`Stale`."""
        endpoint_id = record.endpoint.id if isinstance(record, EndpointUpserted) else record.endpoint_id
        before = self.get(endpoint_id)
        if record.base_version is not None and record.base_version != (before.version if before else 0):
            return Stale(before)
        if isinstance(record, EndpointUpserted):
            after = record.endpoint.model_copy(update={"version": (before.version if before else 0) + 1})
            self._put(before, after)
            # Created again under the id of a deleted one (a notifier's id is derived from its tenant and
            # URL): no longer deleted (the store forgot its deletion), so nothing drains or removes the
            # queues it uses again.
            if endpoint_id in self._deleted_with_queues:
                self._deleted_with_queues.discard(endpoint_id)
                self._sets_changed = True
            self._drained(after.tenant, endpoint_id)
            if before is not None and before.queue_generation != after.queue_generation:
                # A queue of the next generation: the one it had is among those it left (drained);
                # the new one exists only if it is isolated.
                self._has_queue.discard(endpoint_id)
            self._changed(after)
            self._notify(before, after)
            return after
        if before is not None:
            self._remove(before, record.at)
            if endpoint_id in self._queued:
                self._deleted_with_queues.add(endpoint_id)
            if before.laned:
                self._deleting.setdefault(before.tenant, {})[endpoint_id] = before
            if self._placements.pop(endpoint_id, None) is not None:
                self.store.keep("placement", endpoint_id, None)
            self._has_queue.discard(endpoint_id)
            self._queued.discard(endpoint_id)
            self._sets_changed = True
            self._forget_matches(before.tenant)
            self._notify(before, None)
        return None

    def _put(self, before: StoredEndpoint | None, after: StoredEndpoint) -> None:
        self.store.put(
            after.id,
            after.tenant,
            notifications.notifier_of(after),
            after.laned,
            after.model_dump_json().encode(),
        )
        self._count += before is None
        self._cache(after)
        if before is not None and before.tenant != after.tenant:
            self._leave_tenant(before)
        cached = self._by_tenant.get(after.tenant)
        if cached is not None:
            self._by_tenant_size += after.id not in cached
            cached[after.id] = after

    def _remove(self, before: StoredEndpoint, at: datetime) -> None:
        self.store.delete(before.id, before.tenant, _seconds(at), before.model_dump_json().encode())
        self._count -= 1
        self._by_id.pop(before.id, None)
        self._leave_tenant(before)

    def _leave_tenant(self, endpoint: StoredEndpoint) -> None:
        cached = self._by_tenant.get(endpoint.tenant)
        if cached is not None and cached.pop(endpoint.id, None) is not None:
            self._by_tenant_size -= 1

    def apply_drained(self, record: EndpointDrained) -> None:
        if self.deleting(record.endpoint_id):
            gone = self._deleted(record.endpoint_id)
            assert gone is not None
            self._drained(gone[0].tenant, record.endpoint_id)
            self._notify(gone[0], None)  # its patterns are no longer needed for it

    def patterns_needed(self, tenant: str) -> set[str]:
        """The patterns the tenant's lane must stay bound for: those of its endpoints (but those an
        endpoint's queue of its own is bound to ``events`` for: :meth:`lane_patterns`), and of those
        deleted whose lane has not passed the fence yet (their events still become dead letters)."""
        live = (p for e in self._tenant(tenant).values() if e.on_lane for p in self.lane_patterns(e))
        deleting = (p for e in self._deleting.get(tenant, {}).values() if e.on_lane for p in e.event_types)
        return {*live, *deleting}

    def lane_patterns(self, endpoint: StoredEndpoint) -> list[str]:
        """The endpoint's patterns its lane must be bound for: all of them, but those its current queue of
        its own is bound to ``events`` for (:meth:`direct`)."""
        route = self.direct(endpoint)
        if route is None or route.queue != topology.own_queue(endpoint) or not self.has_queue(endpoint.id):
            return endpoint.event_types
        return [pattern for pattern in endpoint.event_types if pattern not in route.patterns]

    def direct(self, endpoint: StoredEndpoint) -> DirectRoute | None:
        """The endpoint's queue of its own bound to ``events`` directly, as its placement records it."""
        where = self._placements.get(endpoint.id)
        return where.direct if where is not None else None

    def directly_routed(self) -> list[tuple[str, DirectRoute]]:
        """Every placement that records a direct route: (endpoint id, the route), the endpoint live or not."""
        return [
            (endpoint_id, where.direct)
            for endpoint_id, where in sorted(self._placements.items())
            if where.direct
        ]

    def deleting_of_tenant(self, tenant: str) -> list[StoredEndpoint]:
        """The tenant's endpoints deleted whose lane has not passed the deletion's fence yet."""
        return list(self._deleting.get(tenant, {}).values())

    def deleting(self, endpoint_id: str) -> bool:
        """Deleted, and its lane has not passed the deletion's fence yet."""
        return any(endpoint_id in endpoints for endpoints in self._deleting.values())

    def _drained(self, tenant: str, endpoint_id: str) -> None:
        deleting = self._deleting.get(tenant)
        if deleting is not None and deleting.pop(endpoint_id, None) is not None:
            if not deleting:
                del self._deleting[tenant]
            self._sets_changed = True
            self._forget_matches(tenant)

    def apply_placement(self, record: PlacementSet) -> Placement | Stale:
        """Apply a placement change: the placement as it now is, or :class:`Stale` when another change
        came first (or the endpoint is gone)."""
        endpoint_id = record.placement.endpoint_id
        endpoint = self.get(endpoint_id)
        current = self._placements.get(endpoint_id)
        if endpoint is None or record.base_generation != (current.generation if current else 0):
            return Stale(endpoint)
        placed = record.placement
        if (
            placed.bound is not None
            and placed.isolated
            and not placed.held
            and endpoint_id not in self._queued
            and len(self._queued) >= placed.bound
        ):
            # Isolations written by other processes came first and reached the bound: held instead, as
            # every replica folding the log in the same order decides.
            placed = placed.model_copy(update={"held": True})
        self._placements[endpoint_id] = placed
        self.store.keep("placement", endpoint_id, placed.model_dump_json().encode())
        if placed.queue_removed:
            self._has_queue.discard(endpoint_id)
        self._changed(endpoint)
        self._notify(endpoint, endpoint)
        return placed

    def _changed(self, endpoint: StoredEndpoint) -> None:
        if self.isolated(endpoint) and not self.held(endpoint):
            self._has_queue.add(endpoint.id)
        if endpoint.id in self._has_queue or endpoint.retired_queues:
            self._queued.add(endpoint.id)
        else:
            self._queued.discard(endpoint.id)
        self._sets_changed = True
        self._forget_matches(endpoint.tenant)

    def _forget_matches(self, tenant: str) -> None:
        self._matches_kept -= len(self._matches.pop(tenant, {}))

    def _notify(self, before: StoredEndpoint | None, after: StoredEndpoint | None) -> None:
        for listener in self._listeners:
            listener(before, after)


@asynccontextmanager
async def kept_at(path: Path | None, *, vhost: str) -> AsyncIterator[EndpointRegistry]:
    """A registry whose store is the file at ``path`` (None: in memory, built from the log at every
    start), for the change log of ``vhost``; closed (what it had not committed, committed) on the way
    out, after whatever follows the log into it has stopped."""
    identity = f"{vhost}/{topology.ENDPOINT_LOG}/{_STORE_VERSION}"
    kept = EndpointRegistry(RegistryStore(path, identity=identity, reads=readable_records()))
    try:
        yield kept
    finally:
        kept.close()


@functools.cache
def readable_records() -> str:
    """A fingerprint of the change-log records this version reads: it differs in a version that reads
    records this one cannot (a new kind, a new field)."""
    schema = json.dumps(_records.json_schema(), sort_keys=True).encode()
    return hashlib.sha256(schema).hexdigest()[:16]


def _seconds(at: datetime) -> float:
    return at.timestamp() if at.year > 1 else 0.0


class ChangeLog:
    """Reads the endpoint change log into a registry, the event-type catalog and the tenants' tokens and
    quotas (a supervised loop) and appends records to it."""

    def __init__(
        self,
        broker: Broker,
        publisher: Publisher,
        registry: EndpointRegistry,
        event_types: catalog.Catalog | None = None,
    ) -> None:
        self.registry = registry
        self.catalog = event_types if event_types is not None else catalog.Catalog()
        self.tenants = Tenants()
        self._follower = StreamFollower(broker, topology.ENDPOINT_LOG, self._on_record, publisher=publisher)
        self._user = broker.user
        self._caught_up_lock = asyncio.Lock()
        self._caught_up_asked = self._caught_up_to = 0
        self._caught_up_at_s = -CAUGHT_UP_EVERY_S

    def resume(self) -> None:
        """Start from the registry's store: the event types, tokens and quotas it kept, and the change
        log from the record after the last one it holds (from the first when it holds none)."""
        offset = self.registry.open()
        if offset is None:
            return
        store = self.registry.store
        self.catalog.restore(EventTypeInfo.model_validate_json(body) for body in store.kept("type"))
        self.tenants.restore(
            (StoredToken.model_validate_json(body) for body in store.kept("token")),
            {quota.tenant: quota.quota for quota in map(QuotaSet.model_validate_json, store.kept("quota"))},
        )
        self._follower.next_offset = offset + 1
        log.info("registry_resumed", path=str(store.path), offset=offset, endpoints=len(self.registry))

    @property
    def applied_offset(self) -> int | None:
        """The stream offset of the last record applied (None: none yet): the state is that of the log
        up to there (a backup names it)."""
        next_offset = self._follower.next_offset
        return next_offset - 1 if isinstance(next_offset, int) else None

    async def write(
        self, record: EndpointUpserted | EndpointDeleted, *, timeout_s: float
    ) -> StoredEndpoint | None:
        """Append a record and wait until this process has applied it (read-your-writes): the endpoint
        as it now is (None when deleted). Raises :class:`StaleWriteError` when a conditional change lost."""
        result = await self._append(record, timeout_s=timeout_s)
        if isinstance(result, Stale):
            raise StaleWriteError(result.current)
        assert result is None or isinstance(result, StoredEndpoint)
        return result

    async def write_event_type(
        self, record: EventTypeUpserted | EventTypeDeleted, *, timeout_s: float
    ) -> EventTypeInfo | None:
        """As :meth:`write`, for the catalog; raises :class:`StaleEventTypeError`."""
        result = await self._append(record, timeout_s=timeout_s)
        if isinstance(result, catalog.Stale):
            raise StaleEventTypeError(result.current)
        assert result is None or isinstance(result, EventTypeInfo)
        return result

    async def write_token(self, token: StoredToken, *, timeout_s: float) -> StoredToken:
        """Append a token (new, or changed: expiry, revocation) and wait until it applies here."""
        record = TokenUpserted(change_id=new_id("chg"), at=datetime.now(UTC), token=token)
        result = await self._append(record, timeout_s=timeout_s)
        assert isinstance(result, StoredToken)
        return result

    async def write_quota(self, tenant: str, quota: TenantQuota, *, timeout_s: float) -> TenantQuota:
        record = QuotaSet(change_id=new_id("chg"), at=datetime.now(UTC), tenant=tenant, quota=quota)
        result = await self._append(record, timeout_s=timeout_s)
        assert isinstance(result, TenantQuota)
        return result

    async def _append(self, record: ChangeRecord, *, timeout_s: float) -> object:
        message = aio_pika.Message(
            _records.dump_json(record),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=record.change_id,
            user_id=self._user,  # RabbitMQ refuses a user_id that is not the connection's user
        )
        return await self._follower.append(message, timeout_s=timeout_s)

    async def drained(self, endpoint_id: str, *, timeout_s: float) -> None:
        """The deleted endpoint's lane has passed the deletion's fence (EndpointDrained)."""
        record = EndpointDrained(change_id=new_id("chg"), at=datetime.now(UTC), endpoint_id=endpoint_id)
        await self._append(record, timeout_s=timeout_s)

    async def place(
        self,
        endpoint_id: str,
        *,
        isolated: bool,
        reason: str,
        timeout_s: float,
        queue_removed: bool = False,
        held: bool = False,
        bound: int | None = None,
    ) -> Placement | None:
        """Isolate the endpoint (or take it back to its lane), on its placement as this process knows it;
        the placement as written, or None when it is gone or another writer changed it meanwhile (that
        one stands: whoever wanted this looks again). A direct route it has stays while it is isolated;
        taken back to its lane, it must have none (:meth:`route`: the lane is bound for it again first)."""
        current = self.registry.placement(endpoint_id)
        direct = current.direct if current is not None and isolated else None
        if not isolated and current is not None and current.direct is not None:
            raise ValueError(f"{endpoint_id} is routed directly: its lane is to be bound again first")
        now = datetime.now(UTC)
        record = PlacementSet(
            change_id=new_id("chg"),
            at=now,
            placement=Placement(
                endpoint_id=endpoint_id,
                generation=(current.generation if current else 0) + 1,
                isolated=isolated,
                reason=reason,
                at=now,
                queue_removed=queue_removed,
                held=held,
                bound=bound,
                direct=direct,
            ),
            base_generation=current.generation if current else 0,
        )
        result = await self._append(record, timeout_s=timeout_s)
        return result if isinstance(result, Placement) else None

    async def route(
        self, endpoint_id: str, direct: DirectRoute | None, *, timeout_s: float
    ) -> Placement | None:
        """The isolated endpoint's placement as it is, with ``direct`` as its direct route (None: none);
        the placement as written, or None when another writer changed it meanwhile."""
        current = self.registry.placement(endpoint_id)
        if current is None or not current.isolated or current.held:
            return None
        record = PlacementSet(
            change_id=new_id("chg"),
            at=datetime.now(UTC),
            placement=current.model_copy(update={"generation": current.generation + 1, "direct": direct}),
            base_generation=current.generation,
        )
        result = await self._append(record, timeout_s=timeout_s)
        return result if isinstance(result, Placement) else None

    async def upsert(
        self, endpoint: StoredEndpoint, *, base_version: int, timeout_s: float
    ) -> StoredEndpoint:
        """Write ``endpoint`` if it is still at ``base_version`` (0: create); the stored result."""
        record = EndpointUpserted(
            change_id=new_id("chg"), at=datetime.now(UTC), endpoint=endpoint, base_version=base_version
        )
        written = await self.write(record, timeout_s=timeout_s)
        assert written is not None
        return written

    async def create_many(
        self, endpoints: Sequence[StoredEndpoint], *, timeout_s: float
    ) -> list[StoredEndpoint | Stale]:
        """Create ``endpoints`` (none may exist yet) in one record: each as stored, or :class:`Stale`
        where one of that id existed already; in order."""
        now = datetime.now(UTC)
        record = EndpointsUpserted(
            change_id=new_id("chg"),
            at=now,
            upserts=[
                EndpointUpserted(change_id=new_id("chg"), at=now, endpoint=endpoint, base_version=0)
                for endpoint in endpoints
            ],
        )
        results = await self._append(record, timeout_s=timeout_s)
        assert isinstance(results, list)
        assert len(results) == len(endpoints)
        return results

    async def update(
        self,
        endpoint_id: str,
        change: Callable[[StoredEndpoint], StoredEndpoint | None],
        *,
        timeout_s: float,
        attempts: int = 5,
    ) -> StoredEndpoint | None:
        """An internal writer's change, applied to the current definition and retried when another write
        wins meanwhile. ``change`` returns the new definition, or None when there is nothing (more) to
        do; the result is the endpoint as written, or None when nothing was written."""
        for _ in range(attempts):
            await self.sync(timeout_s=timeout_s)
            current = self.registry.get(endpoint_id)
            if current is None:
                return None
            after = change(current)
            if after is None:
                return None
            try:
                return await self.upsert(after, base_version=current.version, timeout_s=timeout_s)
            except StaleWriteError:
                log.info("endpoint_change_retried", endpoint_id=endpoint_id)
        raise StaleWriteError(self.registry.get(endpoint_id))

    async def disable(
        self, endpoint_id: str, *, unless: frozenset[EndpointStatus], timeout_s: float
    ) -> StoredEndpoint | None:
        """hookline's own decision to stop delivering to an endpoint (a 410, a breaker open too long):
        a conditional change of its current definition (an edit made meanwhile survives; a deleted one
        stays deleted), skipped when its status is in ``unless``; the endpoint as written, or None."""

        def disabled(endpoint: StoredEndpoint) -> StoredEndpoint | None:
            if endpoint.status in unless or endpoint.status is EndpointStatus.DISABLED:
                return None
            return endpoint.model_copy(
                update={"status": EndpointStatus.DISABLED, "updated_at": datetime.now(UTC)}
            )

        return await self.update(endpoint_id, disabled, timeout_s=timeout_s)

    async def sync(self, *, timeout_s: float) -> None:
        """Return once every record written before this call has been applied."""
        await self._follower.sync(timeout_s=timeout_s)

    async def caught_up(self, *, timeout_s: float) -> None:
        """As :meth:`sync`, shared: whoever calls while a sync is under way waits for the next one, which
        covers every caller before it began, and syncs are ``CAUGHT_UP_EVERY_S`` apart at least. A flood
        of callers (every event of a burst refused by a schema) writes a marker a second between them,
        not one each."""
        self._caught_up_asked += 1
        asked = self._caught_up_asked
        async with self._caught_up_lock:
            if self._caught_up_to >= asked:
                return  # a sync begun after this call has finished meanwhile
            await asyncio.sleep(self._caught_up_at_s + CAUGHT_UP_EVERY_S - time.monotonic())
            covering = self._caught_up_asked
            await self.sync(timeout_s=timeout_s)
            self._caught_up_at_s = time.monotonic()
            self._caught_up_to = covering

    def _on_record(self, message: Record) -> object:
        result = self._apply(message)
        offset = offset_of(message)
        if offset is not None:
            self.registry.store.applied(offset)
        return result

    def _apply_tenant_record(self, record: TokenUpserted | QuotaSet, body: bytes) -> object:
        kept = self.tenants.apply(record)
        if isinstance(record, QuotaSet):
            self.registry.store.keep("quota", record.tenant, body)
        elif isinstance(kept, StoredToken):  # as applied (a revocation stands)
            self.registry.store.keep("token", kept.id, kept.model_dump_json().encode())
        return kept

    def _apply(self, message: Record) -> object:
        if message.body.startswith(_LEGACY_SYNC):
            return None  # read-back markers of versions that wrote them as records
        try:
            record = _records.validate_json(message.body)
        except ValidationError as exc:
            # A record this version cannot read is skipped loudly rather than stopping the service.
            log.error("endpoint_log_record_unreadable", offset=offset_of(message), error=error_summary(exc))
            self.registry.store.skipped()  # a later version reads the log again (registrystore.py)
            return None
        if isinstance(record, TokenUpserted | QuotaSet):
            if not permissions.trusted_writer(message.user_id):
                # The dispatchers and monitors may append to this log (to disable an endpoint), never
                # a token or a quota: such a record is forged.
                log.error("tenant_record_refused", offset=offset_of(message), user=message.user_id)
                return None
            return self._apply_tenant_record(record, message.body)
        if isinstance(record, EndpointDrained):
            self.registry.apply_drained(record)
            return None
        if isinstance(record, PlacementSet):
            placed = self.registry.apply_placement(record)
            if isinstance(placed, Stale):
                log.info("placement_change_stale", endpoint_id=record.placement.endpoint_id)
            return placed
        if isinstance(record, EventTypeUpserted | EventTypeDeleted):
            applied = self.catalog.apply(record)
            if isinstance(applied, catalog.Stale):
                log.info("event_type_change_stale", base_version=record.base_version)
            else:
                name = record.event_type.name if isinstance(record, EventTypeUpserted) else record.name
                body = applied.model_dump_json().encode() if applied is not None else None
                self.registry.store.keep("type", name, body)
            return applied
        if isinstance(record, EndpointsUpserted):
            return [self._apply_endpoint(upsert) for upsert in record.upserts]
        return self._apply_endpoint(record)

    def _apply_endpoint(self, record: EndpointUpserted | EndpointDeleted) -> StoredEndpoint | Stale | None:
        result = self.registry.apply(record)
        if isinstance(result, Stale):
            endpoint_id = record.endpoint.id if isinstance(record, EndpointUpserted) else record.endpoint_id
            log.info("endpoint_change_stale", endpoint_id=endpoint_id, base_version=record.base_version)
        return result


async def follow(
    broker: Broker,
    publisher: Publisher,
    supervisor: Supervisor,
    registry: EndpointRegistry,
    *,
    sync_timeout_s: float,
    event_types: catalog.Catalog | None = None,
) -> ChangeLog:
    """Replay the change log into ``registry`` (and ``event_types``) and keep following it under
    ``supervisor``; returns once caught up (a service is not ready before it knows every endpoint)."""
    change_log = ChangeLog(broker, publisher, registry, event_types)
    change_log.resume()
    await follow_synced(supervisor, LOOP, change_log._follower, timeout_s=sync_timeout_s)
    return change_log
