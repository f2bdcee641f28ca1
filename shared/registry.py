"""Endpoint definitions, shared by every replica of every service through a RabbitMQ stream.

The stream ``hookline.endpoints`` is a change log: each record upserts or deletes one endpoint. Every
service replays it from the first offset at start and then follows it live, so a dispatcher started
later (or restarted) knows every endpoint without another database. :class:`EndpointRegistry` is the
in-memory result; :class:`ChangeLog` does the I/O.

To know when the replay has caught up, a reader appends a sync marker of its own and waits until it
reads it back: everything written before the marker has then been applied. Writers use the same
read-back to give read-your-writes (``POST`` then ``GET`` on any ingest replica sees the endpoint).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aio_pika
import structlog
from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractRobustChannel,
    AbstractRobustConnection,
    AbstractRobustQueue,
)
from hookline.shared import topology
from hookline.shared.models import (
    ChangeRecord,
    EndpointDeleted,
    EndpointUpserted,
    StoredEndpoint,
    SyncMarker,
)
from pydantic import TypeAdapter, ValidationError

log = structlog.get_logger(__name__)

_records: TypeAdapter[ChangeRecord] = TypeAdapter(ChangeRecord)

#: Called with (before, after) for every endpoint that changed; either side is None on create/delete.
Listener = Callable[[StoredEndpoint | None, StoredEndpoint | None], None]


class EndpointRegistry:
    """The endpoints as of the last change-log record applied."""

    def __init__(self) -> None:
        self._endpoints: dict[str, StoredEndpoint] = {}
        # Deleted endpoints' last definitions: messages still on their way can be dead-lettered by tenant.
        self._deleted: dict[str, StoredEndpoint] = {}
        self._waiting: dict[str, asyncio.Future[None]] = {}
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

    def expect(self, change_id: str) -> asyncio.Future[None]:
        """A future resolved when the record with ``change_id`` is applied. Call before writing it."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[change_id] = future
        return future

    def forget(self, change_id: str) -> None:
        self._waiting.pop(change_id, None)

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
        waiter = self._waiting.pop(record.change_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _notify(self, before: StoredEndpoint | None, after: StoredEndpoint | None) -> None:
        for listener in self._listeners:
            listener(before, after)


class ChangeLog:
    """Reads the endpoint change log into a registry and appends records to it."""

    def __init__(self, connection: AbstractRobustConnection, registry: EndpointRegistry) -> None:
        self._connection = connection
        self.registry = registry
        self._read_channel: AbstractRobustChannel | None = None
        self._write_channel: AbstractRobustChannel | None = None
        self._stream: AbstractRobustQueue | None = None
        self._next_offset: int | str = "first"
        self._consumer_tag: str | None = None

    async def start(self, *, sync_timeout_s: float) -> None:
        # on_return_raises: an unroutable or refused write raises instead of passing for a confirm.
        self._write_channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        await topology.endpoint_log(self._write_channel)
        self._read_channel = await self._connection.channel()
        # A stream consumer must set a prefetch; acks only return credit.
        await self._read_channel.set_qos(prefetch_count=500)
        self._stream = await topology.endpoint_log(self._read_channel)
        await self._subscribe()
        # A robust consumer would resume from its original offset after a reconnect (replaying the
        # whole log); resume from the next unread offset instead.
        self._connection.reconnect_callbacks.add(self._on_reconnect)
        await self.sync(timeout_s=sync_timeout_s)

    async def stop(self) -> None:
        self._connection.reconnect_callbacks.discard(self._on_reconnect)
        for channel in (self._read_channel, self._write_channel):
            if channel is not None and not channel.is_closed:
                await channel.close()

    async def append(self, record: ChangeRecord, *, timeout_s: float) -> None:
        """Append a record and wait until this process has applied it (read-your-writes)."""
        assert self._write_channel is not None, "start() first"
        applied = self.registry.expect(record.change_id)
        try:
            await self._write_channel.default_exchange.publish(
                aio_pika.Message(
                    _records.dump_json(record),
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    message_id=record.change_id,
                ),
                routing_key=topology.ENDPOINT_LOG,
                timeout=timeout_s,
            )
            await asyncio.wait_for(applied, timeout_s)
        finally:
            self.registry.forget(record.change_id)

    async def sync(self, *, timeout_s: float) -> None:
        """Return once every record written before this call has been applied."""
        await self.append(SyncMarker(change_id=f"sync_{uuid.uuid4().hex}"), timeout_s=timeout_s)

    async def _subscribe(self) -> None:
        assert self._stream is not None
        self._consumer_tag = await self._stream.consume(
            self._on_record, arguments={"x-stream-offset": self._next_offset}, robust=False
        )

    async def _on_reconnect(self, *_: object) -> None:
        log.info("endpoint_log_resubscribe", offset=self._next_offset)
        await self._subscribe()

    async def _on_record(self, message: AbstractIncomingMessage) -> None:
        offset = (message.headers or {}).get("x-stream-offset")
        if isinstance(offset, int):
            self._next_offset = offset + 1
        try:
            record = _records.validate_json(message.body)
        except ValidationError as exc:
            # A record this version cannot read is skipped loudly rather than stopping the service.
            log.error("endpoint_log_record_unreadable", offset=offset, error=str(exc.errors()[:1]))
        else:
            self.registry.apply(record)
        await message.ack()


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
