"""Endpoint definitions, shared by every replica of every service through a RabbitMQ stream.

The stream ``hookline.endpoints`` is a change log: each record upserts or deletes one endpoint. Every
service replays it from the first offset at start and then follows it live, so a dispatcher started
later (or restarted) knows every endpoint without another database. :class:`EndpointRegistry` is the
in-memory result; :class:`ChangeLog` does the I/O.

To know when the replay has caught up, a reader appends a marker of its own and waits until it reads
it back (:mod:`hookline.shared.streams`). Writers wait for their own record the same way, which gives
read-your-writes (``POST`` then ``GET`` on any ingest replica sees the endpoint).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aio_pika
import structlog
from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractRobustConnection,
)
from pydantic import TypeAdapter, ValidationError

from hookline.shared import topology
from hookline.shared.models import (
    ChangeRecord,
    EndpointDeleted,
    EndpointUpserted,
    StoredEndpoint,
    error_summary,
)
from hookline.shared.streams import StreamFollower

log = structlog.get_logger(__name__)

_records: TypeAdapter[ChangeRecord] = TypeAdapter(ChangeRecord)
_LEGACY_SYNC = b'{"kind":"sync"'

#: Called with (before, after) for every endpoint that changed; either side is None on create/delete.
Listener = Callable[[StoredEndpoint | None, StoredEndpoint | None], None]


class EndpointRegistry:
    """The endpoints as of the last change-log record applied."""

    def __init__(self) -> None:
        self._endpoints: dict[str, StoredEndpoint] = {}
        # Deleted endpoints' last definitions: messages still on their way can be dead-lettered by tenant.
        self._deleted: dict[str, StoredEndpoint] = {}
        self._listeners: list[Listener] = []

    def get(self, endpoint_id: str) -> StoredEndpoint | None:
        return self._endpoints.get(endpoint_id)

    def last_known(self, endpoint_id: str) -> StoredEndpoint | None:
        """The endpoint, or its definition when it was deleted."""
        return self._endpoints.get(endpoint_id) or self._deleted.get(endpoint_id)

    def all(self) -> list[StoredEndpoint]:
        return list(self._endpoints.values())

    def __len__(self) -> int:
        return len(self._endpoints)

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def apply(self, record: ChangeRecord) -> None:
        if isinstance(record, EndpointUpserted):
            before = self._endpoints.get(record.endpoint.id)
            self._endpoints[record.endpoint.id] = record.endpoint
            self._notify(before, record.endpoint)
        elif isinstance(record, EndpointDeleted):
            before = self._endpoints.pop(record.endpoint_id, None)
            if before is not None:
                self._deleted[before.id] = before
                self._notify(before, None)

    def _notify(self, before: StoredEndpoint | None, after: StoredEndpoint | None) -> None:
        for listener in self._listeners:
            listener(before, after)


class ChangeLog:
    """Reads the endpoint change log into a registry and appends records to it."""

    def __init__(self, connection: AbstractRobustConnection, registry: EndpointRegistry) -> None:
        self.registry = registry
        self._follower = StreamFollower(connection, topology.ENDPOINT_LOG, self._on_record)

    async def start(self, *, sync_timeout_s: float) -> None:
        await self._follower.start()
        await self._follower.sync(timeout_s=sync_timeout_s)

    async def stop(self) -> None:
        await self._follower.stop()

    async def append(self, record: ChangeRecord, *, timeout_s: float) -> None:
        """Append a record and wait until this process has applied it (read-your-writes)."""
        message = aio_pika.Message(
            _records.dump_json(record),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=record.change_id,
        )
        await self._follower.append(message, timeout_s=timeout_s)

    async def sync(self, *, timeout_s: float) -> None:
        """Return once every record written before this call has been applied."""
        await self._follower.sync(timeout_s=timeout_s)

    def _on_record(self, message: AbstractIncomingMessage) -> None:
        if message.body.startswith(_LEGACY_SYNC):
            return  # read-back markers of versions that wrote them as records
        try:
            record = _records.validate_json(message.body)
        except ValidationError as exc:
            # A record this version cannot read is skipped loudly rather than stopping the service.
            offset = (message.headers or {}).get("x-stream-offset")
            log.error("endpoint_log_record_unreadable", offset=offset, error=error_summary(exc))
            return
        self.registry.apply(record)


@asynccontextmanager
async def follow(
    connection: AbstractRobustConnection, registry: EndpointRegistry, *, sync_timeout_s: float
) -> AsyncIterator[ChangeLog]:
    """Replay the change log into ``registry``, keep following it, and stop on exit."""
    change_log = ChangeLog(connection, registry)
    try:
        await change_log.start(sync_timeout_s=sync_timeout_s)
        yield change_log
    finally:
        await change_log.stop()
