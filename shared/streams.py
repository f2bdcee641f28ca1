"""Reading a RabbitMQ stream from an offset, following it live, and knowing when we have caught up.

Streams are hookline's durable, re-readable logs (endpoint changes, dead letters, accepted events).
A :class:`StreamFollower` consumes one from a starting offset, resumes at the next unread offset after
a reconnect (a robust consumer would start again from its original offset), and can wait until it
has read a given message: :meth:`StreamFollower.sync` appends a marker of its own and waits for it,
which proves that everything written before the marker has been handled.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import datetime

import aio_pika
import structlog
from aio_pika.abc import AbstractIncomingMessage, AbstractRobustChannel, AbstractRobustConnection

log = structlog.get_logger(__name__)

#: Marker messages carry this header; followers skip them after resolving whoever waits for them.
MARKER_HEADER = "x-hookline-marker"

Offset = int | str | datetime  # an offset, "first", "last", "next", or a point in time
Handler = Callable[[AbstractIncomingMessage], None]


class StreamFollower:
    def __init__(
        self,
        connection: AbstractRobustConnection,
        stream: str,
        handler: Handler,
        *,
        start: Offset = "first",
        prefetch: int = 500,
    ) -> None:
        self._connection = connection
        self._stream = stream
        self._handler = handler
        self._next_offset: Offset = start
        self._prefetch = prefetch
        self._read_channel: AbstractRobustChannel | None = None
        self._write_channel: AbstractRobustChannel | None = None
        self._waiting: dict[str, asyncio.Future[None]] = {}

    async def start(self) -> None:
        # on_return_raises: an unroutable write raises instead of passing for a confirm.
        self._write_channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        self._read_channel = await self._connection.channel()
        # A stream consumer must set a prefetch; its acks only return credit.
        await self._read_channel.set_qos(prefetch_count=self._prefetch)
        await self._subscribe()
        self._connection.reconnect_callbacks.add(self._on_reconnect)

    async def stop(self) -> None:
        self._connection.reconnect_callbacks.discard(self._on_reconnect)
        for channel in (self._read_channel, self._write_channel):
            if channel is not None and not channel.is_closed:
                await channel.close()

    async def append(self, message: aio_pika.Message, *, timeout_s: float) -> None:
        """Write ``message`` to the stream and wait until this follower has read it back."""
        assert self._write_channel is not None, "start() first"
        assert message.message_id, "appended messages need a unique message_id"
        read_back = self._expect(message.message_id)
        try:
            await self._write_channel.default_exchange.publish(
                message, routing_key=self._stream, timeout=timeout_s
            )
            await asyncio.wait_for(read_back, timeout_s)
        finally:
            self._waiting.pop(message.message_id, None)

    async def sync(self, *, timeout_s: float) -> None:
        """Return once everything written to the stream before this call has been handled."""
        token = f"marker_{uuid.uuid4().hex}"
        marker = aio_pika.Message(b"", message_id=token, headers={MARKER_HEADER: token})
        await self.append(marker, timeout_s=timeout_s)

    def _expect(self, message_id: str) -> asyncio.Future[None]:
        future = asyncio.get_running_loop().create_future()
        self._waiting[message_id] = future
        return future

    async def _subscribe(self) -> None:
        assert self._read_channel is not None
        queue = await self._read_channel.declare_queue(self._stream, passive=True, robust=False)
        await queue.consume(self._on_message, arguments={"x-stream-offset": self._next_offset}, robust=False)

    async def _on_reconnect(self, *_: object) -> None:
        log.info("stream_resubscribe", stream=self._stream, offset=str(self._next_offset))
        await self._subscribe()

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        headers = message.headers or {}
        offset = headers.get("x-stream-offset")
        if isinstance(offset, int):
            self._next_offset = offset + 1
        if MARKER_HEADER not in headers:
            self._handler(message)
        waiter = self._waiting.pop(message.message_id or "", None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        await message.ack()


async def read_until_now(
    connection: AbstractRobustConnection,
    stream: str,
    handler: Handler,
    *,
    start: Offset,
    timeout_s: float,
) -> None:
    """Hand every message from ``start`` to the present to ``handler``, then stop."""
    follower = StreamFollower(connection, stream, handler, start=start)
    await follower.start()
    try:
        await follower.sync(timeout_s=timeout_s)
    finally:
        await follower.stop()
