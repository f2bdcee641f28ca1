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

import functools
import hashlib
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path

import aio_pika
import structlog

from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.broker.streams import StreamFollower, follow_synced
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
)
from hookline.shared.runtime.supervision import Supervisor
from hookline.shared.state import catalog, changefold
from hookline.shared.state.changefold import ChangeFold, Stale
from hookline.shared.state.deletions import Deletions
from hookline.shared.state.endpointrows import EndpointRows
from hookline.shared.state.placementbook import PlacementBook
from hookline.shared.state.registrystore import RegistryStore
from hookline.shared.state.subscriptions import Subscriptions
from hookline.shared.state.tenants import Tenants

log = structlog.get_logger(__name__)

LOOP = "endpoint-log"
#: What the store's rows mean: a file of another version is built again from the log.
_STORE_VERSION = 1

#: Called with (before, after) for every endpoint that changed; either side is None on create/delete.
Listener = Callable[[StoredEndpoint | None, StoredEndpoint | None], None]


class StaleWriteError(Exception):
    def __init__(self, current: StoredEndpoint | None) -> None:
        super().__init__("the endpoint changed meanwhile")
        self.current = current


class StaleEventTypeError(Exception):
    def __init__(self, current: EventTypeInfo | None) -> None:
        super().__init__("the event type changed meanwhile")
        self.current = current


class EndpointRegistry:
    """The endpoints as of the last change-log record applied, with their placements: one record applied
    to its parts (:meth:`apply`, :meth:`apply_placement`, :meth:`apply_drained`), which answer the
    questions. ``rows``: the endpoints themselves (:mod:`~hookline.shared.state.endpointrows`);
    ``placements``: where each is delivered from (:mod:`~hookline.shared.state.placementbook`);
    ``deletions``: those deleted and what they still owe (:mod:`~hookline.shared.state.deletions`);
    ``subscriptions``: which endpoints an event goes to (:mod:`~hookline.shared.state.subscriptions`).
    What is small stays in memory and is saved with the rows (placements, which endpoints have queues
    of their own, which deleted ones still wait for their fence)."""

    def __init__(self, store: RegistryStore | None = None) -> None:
        self.store = store if store is not None else RegistryStore(None, identity="memory")
        self.rows = EndpointRows(self.store, on_evicted=self._forget_matches)
        self.placements = PlacementBook(self.store, self.rows.get)
        self.deletions = Deletions(self.rows)
        self.subscriptions = Subscriptions(self.rows, self.deletions, self.placements)
        if store is None:
            self.store.open()  # in memory: nothing to read, so usable at once (a test, a backup)
        self.store.batch.before_commit = self._save_sets
        self._listeners: list[Listener] = []

    def _forget_matches(self, tenant: str) -> None:
        self.subscriptions.forget(tenant)  # bound late: the rows exist before the subscriptions

    def open(self) -> int | None:
        """Read the store: the offset of the last change-log record it holds (None: build it from the
        first)."""
        offset = self.store.open()
        self.rows.count = self.store.endpoints.count()
        sets = json.loads(self.store.state("sets") or "{}")
        self.placements.load(has_queue=sets.get("has_queue", ()), queued=sets.get("queued", ()))
        self.deletions.load(
            deleting=sets.get("deleting", ()), with_queues=sets.get("deleted_with_queues", ())
        )
        return offset

    def close(self) -> None:
        self.store.close()

    def _save_sets(self) -> None:
        if self.placements.changed or self.deletions.changed:
            self.placements.changed = self.deletions.changed = False
            sets = {**self.placements.sets(), **self.deletions.sets()}
            self.store.set_state("sets", json.dumps(sets))

    def get(self, endpoint_id: str) -> StoredEndpoint | None:
        return self.rows.get(endpoint_id)

    def __len__(self) -> int:
        return self.rows.count

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def to_settle(self) -> list[StoredEndpoint]:
        """The endpoints whose route the ingest may still have to settle at its start: those not moved
        onto their lane yet, and the ordered ones on it (to leave it, or leaving it: an ordered endpoint
        always has a queue of its own, so they are among the few that have one)."""
        queued = self.placements.with_queues()
        ordered = [endpoint for endpoint in queued if endpoint.ordered and endpoint.laned]
        return sorted([*self.rows.every(unlaned_only=True), *ordered], key=lambda endpoint: endpoint.id)

    def apply(self, record: EndpointUpserted | EndpointDeleted) -> StoredEndpoint | Stale | None:
        """Apply one record: the endpoint as it now is (None once deleted), or :class:`Stale`."""
        endpoint_id = record.endpoint.id if isinstance(record, EndpointUpserted) else record.endpoint_id
        before = self.get(endpoint_id)
        if record.base_version is not None and record.base_version != (before.version if before else 0):
            return Stale(before)
        if isinstance(record, EndpointUpserted):
            after = record.endpoint.model_copy(update={"version": (before.version if before else 0) + 1})
            self.rows.put(before, after)
            self.deletions.created_again(endpoint_id)
            self._drained(after.tenant, endpoint_id)
            new_generation = before is not None and before.queue_generation != after.queue_generation
            self.placements.note(after, new_generation=new_generation)
            self._forget_matches(after.tenant)
            self._notify(before, after)
            return after
        if before is not None:
            self.rows.remove(before, record.at)
            had_queues = self.placements.note(before, deleted=True)
            self.deletions.deleted(before, had_queues=had_queues)
            self._forget_matches(before.tenant)
            self._notify(before, None)
        return None

    def apply_drained(self, record: EndpointDrained) -> None:
        if self.deletions.deleting(record.endpoint_id):
            gone = self.rows.deleted(record.endpoint_id)
            assert gone is not None
            self._drained(gone[0].tenant, record.endpoint_id)
            self._notify(gone[0], None)  # its patterns are no longer needed for it

    def _drained(self, tenant: str, endpoint_id: str) -> None:
        if self.deletions.drained(tenant, endpoint_id):
            self._forget_matches(tenant)

    def apply_placement(self, record: PlacementSet) -> Placement | Stale:
        """Apply a placement change: the placement as it now is, or :class:`Stale` when another change
        came first (or the endpoint is gone)."""
        endpoint_id = record.placement.endpoint_id
        endpoint = self.get(endpoint_id)
        current = self.placements.placement(endpoint_id)
        if endpoint is None or record.base_generation != (current.generation if current else 0):
            return Stale(endpoint)
        placed = self.placements.place(record.placement)
        self.placements.note(endpoint)
        self._forget_matches(endpoint.tenant)
        self._notify(endpoint, endpoint)
        return placed

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
    schema = json.dumps(changefold.records.json_schema(), sort_keys=True).encode()
    return hashlib.sha256(schema).hexdigest()[:16]


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
        self.fold = ChangeFold(registry, self.catalog, self.tenants)
        self._follower = StreamFollower(
            broker, topology.ENDPOINT_LOG, self.fold.on_record, publisher=publisher
        )
        self._user = broker.user

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
            changefold.records.dump_json(record),
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
        current = self.registry.placements.placement(endpoint_id)
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
        current = self.registry.placements.placement(endpoint_id)
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
    offset = change_log.fold.restore()
    if offset is not None:
        change_log._follower.next_offset = offset + 1  # the record after the last one the store holds
    await follow_synced(supervisor, LOOP, change_log._follower, timeout_s=sync_timeout_s)
    return change_log
