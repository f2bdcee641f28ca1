"""Reading a RabbitMQ stream from an offset, following it live, and knowing when we have caught up.

Streams are hookline's durable, re-readable logs (endpoint changes, dead letters, accepted events,
telemetry, breaker commands). A :class:`StreamFollower` is a supervised loop body: it consumes the
stream from its next unread offset, and when its channel goes (broker restart, closed connection) the
supervisor runs it again and it resumes exactly where it was. :meth:`StreamFollower.sync` appends a
marker of its own and waits until it has read it back, which proves that everything written before the
marker has been handled; :meth:`StreamFollower.append` does the same for a record (read-your-writes).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from functools import partial
from typing import Any

import aio_pika
import structlog
from aio_pika.abc import AbstractChannel
from aio_pika.message import decode_timestamp
from aiormq.abc import AbstractChannel as Underlay
from aiormq.abc import DeliveredMessage

from hookline.shared.broker.amqp import (
    BROKER_ERRORS,
    CALL_TIMEOUT_S,
    Broker,
    Publisher,
    close_quietly,
    on_cancel,
    passive_queue,
    until_closed,
)
from hookline.shared.runtime.supervision import Body, Loop, Supervisor

log = structlog.get_logger(__name__)

#: Marker messages carry this header; followers skip them after resolving whoever waits for them.
MARKER_HEADER = "x-hookline-marker"

Offset = int | str | datetime  # an offset, "first", "last", "next", or a point in time


class Record:
    """One message read off a stream, straight from aiormq's delivery: aio-pika's ``IncomingMessage`` (an
    object whose every attribute goes through a checked ``__setattr__``) and the second task it runs
    each callback in were about a fifth of what a service spent reading a record (docs/decisions.md,
    "Streams read off aiormq")."""

    __slots__ = (
        "body",
        "channel",
        "delivery_tag",
        "headers",
        "message_id",
        "routing_key",
        "timestamp",
        "user_id",
    )

    def __init__(self, message: DeliveredMessage) -> None:
        properties = message.header.properties
        self.body: bytes = message.body
        self.channel: Underlay = message.channel
        self.delivery_tag: int | None = message.delivery_tag
        self.headers: dict[str, Any] = properties.headers or {}
        self.message_id: str | None = properties.message_id
        self.routing_key: str | None = message.routing_key
        self.timestamp: datetime | None = decode_timestamp(properties.timestamp)
        self.user_id: str | None = properties.user_id

    async def ack(self, *, multiple: bool = False) -> None:
        assert self.delivery_tag is not None  # consumed with acks: every delivery has a tag
        await self.channel.basic_ack(self.delivery_tag, multiple=multiple)


#: Applies one record; what it returns is handed to whoever waits for that record (see ``append``).
Handler = Callable[[Record], object]


def offset_of(message: Record) -> int | None:
    offset = message.headers.get("x-stream-offset")
    return offset if isinstance(offset, int) else None


async def consume(
    channel: AbstractChannel, stream: str, callback: Callable[[Record], Awaitable[None]], *, start: Offset
) -> tuple[Underlay, str]:
    """Consume ``stream`` (which must exist) on ``channel`` from ``start``; its channel underneath and the
    consumer tag, to cancel it with."""
    await passive_queue(channel, stream)
    underlay = await channel.get_underlay_channel()

    async def on_delivery(message: DeliveredMessage) -> None:
        await callback(Record(message))  # already in a task of its own (aiormq starts one per delivery)

    ok = await underlay.basic_consume(
        stream, on_delivery, arguments={"x-stream-offset": start}, timeout=CALL_TIMEOUT_S
    )
    assert ok.consumer_tag is not None
    return underlay, ok.consumer_tag


class StreamFollower:
    def __init__(
        self,
        broker: Broker,
        stream: str,
        handler: Handler,
        *,
        publisher: Publisher | None = None,
        start: Offset = "first",
        prefetch: int = 500,
    ) -> None:
        self._broker = broker
        self.stream = stream
        self._handler = handler
        self._publisher = publisher
        self.next_offset: Offset = start
        self._prefetch = prefetch
        self._waiting: dict[str, asyncio.Future[object]] = {}
        # Acks go in batches: a stream's acks only return credit, and one frame (and one write) per
        # record was most of what following the event log cost an ingest during a burst.
        self._unacked: Record | None = None  # the last record read, not acked yet
        self._unacked_count = 0
        self._ack_tasks: set[asyncio.Task[None]] = set()  # kept, as the event loop keeps tasks weakly

    async def run(self, loop: Loop) -> None:
        """Consume from the next unread offset until the channel goes (then the supervisor calls again)."""
        async with self._broker.channel(prefetch=self._prefetch) as channel:
            # A stream consumer must set a prefetch; its acks only return credit.
            await consume(channel, self.stream, self._on_message, start=self.next_offset)
            await on_cancel(channel, partial(self._on_stream_deleted, channel))
            if isinstance(self.next_offset, int):
                log.info("stream_following", stream=self.stream, offset=self.next_offset)
            loop.mark_up()
            await until_closed(channel)

    def _on_stream_deleted(self, channel: AbstractChannel, _: object) -> None:
        # The broker cancels a stream's consumers when the stream is deleted; when it is declared again
        # (the monitor does that) its offsets start over, so read the new one from its start.
        log.error("stream_deleted", stream=self.stream, alert=True)
        self.next_offset = "first"
        asyncio.get_running_loop().create_task(close_quietly(channel))

    async def append(self, message: aio_pika.Message, *, timeout_s: float) -> object:
        """Write ``message`` to the stream, wait until this follower has applied it, and return what the
        handler returned for it (for instance whether a conditional change won)."""
        assert self._publisher is not None, "a follower that appends needs a publisher"
        assert message.message_id, "appended messages need a unique message_id"
        read_back = self._expect(message.message_id)
        try:
            async with asyncio.timeout(timeout_s):
                await self._publisher.publish(message, exchange="", routing_key=self.stream)
                return await read_back
        finally:
            self._waiting.pop(message.message_id, None)

    async def sync(self, *, timeout_s: float) -> None:
        """Return once everything written to the stream before this call has been handled."""
        token = f"marker_{uuid.uuid4().hex}"
        marker = aio_pika.Message(b"", message_id=token, headers={MARKER_HEADER: token})
        await self.append(marker, timeout_s=timeout_s)

    def _expect(self, message_id: str) -> asyncio.Future[object]:
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._waiting[message_id] = future
        return future

    async def _on_message(self, message: Record) -> None:
        # Runs before the first await, in delivery order: records are applied in stream order.
        offset = offset_of(message)
        if offset is not None:
            if isinstance(self.next_offset, int) and offset < self.next_offset:
                self._ack_soon(message)
                return  # read twice across a resubscription: applied already
            self.next_offset = offset + 1
        result = None if MARKER_HEADER in message.headers else self._handler(message)
        waiter = self._waiting.pop(message.message_id or "", None)
        if waiter is not None and not waiter.done():
            waiter.set_result(result)
        self._ack_soon(message)

    def _ack_soon(self, message: Record) -> None:
        """Ack ``message`` and every one before it on its channel, once the records read in this turn of
        the event loop are applied (or half the prefetch is, so that credit never runs out)."""
        if self._unacked is not None and self._unacked.channel is not message.channel:
            self._unacked_count = 0  # a new channel: what the old one had is gone with it
        self._unacked = message
        self._unacked_count += 1
        if not self._ack_tasks or self._unacked_count >= self._prefetch // 2:
            task = asyncio.get_running_loop().create_task(self._ack())
            self._ack_tasks.add(task)
            task.add_done_callback(self._ack_tasks.discard)

    async def _ack(self) -> None:
        await asyncio.sleep(0)  # the records read with this one are applied first
        while (message := self._unacked) is not None:  # (more may come while an ack is written)
            self._unacked, self._unacked_count = None, 0
            with contextlib.suppress(*BROKER_ERRORS):  # the channel went: its credit went with it
                await message.ack(multiple=True)


async def read_until_now(
    broker: Broker,
    publisher: Publisher,
    stream: str,
    handler: Handler,
    *,
    start: Offset,
    timeout_s: float,
) -> None:
    """Hand every message from ``start`` to the present to ``handler``, then stop."""
    follower = StreamFollower(broker, stream, handler, publisher=publisher, start=start)
    token = f"marker_{uuid.uuid4().hex}"
    read_back = follower._expect(token)
    async with asyncio.timeout(timeout_s), broker.channel(prefetch=500) as channel:
        underlay, tag = await consume(channel, stream, follower._on_message, start=start)
        marker = aio_pika.Message(b"", message_id=token, headers={MARKER_HEADER: token})
        await publisher.publish(marker, exchange="", routing_key=stream)
        await read_back
        await underlay.basic_cancel(tag, timeout=CALL_TIMEOUT_S)


async def read_at(broker: Broker, stream: str, offset: int, *, timeout_s: float) -> bytes | None:
    """The body of the record at ``offset``; None when retention has removed it."""
    return (await read_many(broker, stream, [offset], timeout_s=timeout_s)).get(offset)


#: Offsets this close to one another are read with one consumer, the records between them passed over:
#: reading past a thousand records costs less than a consumer of its own for each wanted one.
READ_RUN_GAP = 1_000
READ_RUN_PREFETCH = 500


async def read_many(
    broker: Broker, stream: str, offsets: Iterable[int], *, timeout_s: float
) -> dict[int, bytes]:
    """The bodies of the records at ``offsets``, by offset (one retention has removed is missing): each
    run of nearby offsets read by one consumer from its first to its last."""
    found: dict[int, bytes] = {}
    runs: list[list[int]] = []
    for offset in sorted(set(offsets)):
        if runs and offset - runs[-1][-1] <= READ_RUN_GAP:
            runs[-1].append(offset)
        else:
            runs.append([offset])
    for run in runs:
        found |= await _read_run(broker, stream, run, timeout_s=timeout_s)
    return found


async def _read_run(broker: Broker, stream: str, run: list[int], *, timeout_s: float) -> dict[int, bytes]:
    wanted, last = set(run), run[-1]
    found: dict[int, bytes] = {}
    reached: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def on_message(message: Record) -> None:
        offset = offset_of(message)
        if offset is not None and offset in wanted:
            found[offset] = message.body
        if offset is None or offset >= last:
            if not reached.done():
                reached.set_result(None)
        else:
            await message.ack()  # credit for the next ones (a stream's acks remove nothing)

    prefetch = min(READ_RUN_PREFETCH, last - run[0] + 1)  # no more than the run holds
    async with asyncio.timeout(timeout_s), broker.channel(prefetch=prefetch) as channel:
        # From an offset older than the stream's first, reading starts at its first record instead.
        underlay, tag = await consume(channel, stream, on_message, start=run[0])
        await reached
        await underlay.basic_cancel(tag, timeout=CALL_TIMEOUT_S)
    return found


async def follow_synced(
    supervisor: Supervisor,
    name: str,
    follower: StreamFollower,
    body: Body | None = None,
    *,
    timeout_s: float,
    sync_timeout_s: float | None = None,
) -> None:
    """Start following a stream as the supervised loop ``name`` (``body``, or the follower's own run)
    and return once what was written to it before has been read: a service that answers from a stream
    is not ready before it has caught up. ``timeout_s`` for the loop to be up, ``sync_timeout_s`` (the
    same by default) to catch up."""
    supervisor.spawn(name, body or follower.run)
    await supervisor.wait_up(name, timeout_s=timeout_s)
    # A long log (a million endpoints built into a new file) takes longer than any timeout meant for a
    # broker that does not answer: the wait goes on for as long as the follower is still moving on.
    while True:
        offset_before = follower.next_offset
        try:
            await follower.sync(timeout_s=timeout_s if sync_timeout_s is None else sync_timeout_s)
            return
        except TimeoutError:
            if follower.next_offset == offset_before or not isinstance(follower.next_offset, int):
                raise
            log.info("stream_catching_up", stream=follower.stream, offset=follower.next_offset)
