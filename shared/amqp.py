"""The broker session every service holds: one AMQP connection, reopened whenever it is lost, the channels
its loops open from it, and publishing with a deadline.

Nothing here is "robust" in aio-pika's sense, on purpose: a robust connection restores queues,
bindings and consumers behind the code's back (a deleted endpoint's queue comes back, a queue restored
with stale arguments fails the whole recovery, a consumer lost to a channel error is never noticed).
Instead each loop owns its channels: when the connection or a channel goes, the loop's body raises,
its supervisor (:mod:`hookline.shared.supervision`) runs it again, and it declares and consumes afresh
on a new connection. Every wait on the broker has a deadline, so a stalled connection shows up as an
error rather than a loop hung for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Self
from urllib.parse import parse_qsl, urlsplit

import aio_pika
import aiormq
import prometheus_client
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange, AbstractQueue

log = structlog.get_logger(__name__)

#: A publish or broker call that raised one of these did not happen (or its outcome is unknown):
#: try again later. ChannelInvalidStateError (a RuntimeError) is what a channel raises once it is closed.
BROKER_ERRORS: tuple[type[BaseException], ...] = (
    aio_pika.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    asyncio.TimeoutError,
    ConnectionError,
    OSError,
)

#: Without a heartbeat a connection to a broker that went silent (a cut cable, a stalled proxy) looks
#: alive for as long as TCP keeps it. With 5 s the broker notices within about 10 s (two missed beats) and
#: aiormq within about 18 s ((5 + 1) × 3). A URL may override it.
DEFAULT_HEARTBEAT_S = 5
#: How long one broker call (open a channel, declare, publish and confirm) may take before it counts as failed.
CALL_TIMEOUT_S = 10.0
_RECONNECT_MIN_S = 0.5
_RECONNECT_MAX_S = 5.0

RECONNECTS = prometheus_client.Counter(
    "hookline_broker_reconnects", "Times this process connected to the broker again after losing it."
)
CONNECTED = prometheus_client.Gauge("hookline_broker_connected", "1 while connected to the broker.")


class ChannelLostError(ConnectionError):
    """A channel a loop was using has closed (the connection went, or the broker closed the channel)."""


class Broker:
    """One connection per process: opened at start (or the service exits), reopened on demand after a loss.

    ``async with Broker(url, name=..., connect_timeout_s=...) as broker`` — a broker that cannot be
    reached within ``connect_timeout_s`` at start stops the service (exit 1); later losses are retried
    for as long as the service runs, with a backoff, by whichever loop needs the connection first.
    """

    def __init__(self, url: str, *, name: str, connect_timeout_s: float) -> None:
        self._name = f"{name}:{os.getpid()}"
        self._connect_timeout_s = connect_timeout_s
        if "heartbeat" not in dict(parse_qsl(urlsplit(url).query)):
            url += ("&" if urlsplit(url).query else "?") + f"heartbeat={DEFAULT_HEARTBEAT_S}"
        self._url = url
        self._connection: AbstractConnection | None = None
        self._lock = asyncio.Lock()
        self._closing = False
        self.vhost = urlsplit(url).path.lstrip("/") or "/"

    async def __aenter__(self) -> Self:
        deadline = time.monotonic() + self._connect_timeout_s
        while True:
            try:
                await self.connection(timeout_s=min(CALL_TIMEOUT_S, self._connect_timeout_s), retry=False)
                return self
            except BROKER_ERRORS as exc:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    log.error("broker_unreachable", error=type(exc).__name__, detail=str(exc)[:300])
                    raise SystemExit(1) from None
                log.warning(
                    "broker_connect_retry", error=type(exc).__name__, remaining_s=round(remaining_s, 1)
                )
                await asyncio.sleep(min(1.0, remaining_s))

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._closing = True
        connection, self._connection = self._connection, None
        CONNECTED.set(0)
        if connection is not None:
            with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    await connection.close()

    @property
    def connected(self) -> bool:
        connection = self._connection
        return connection is not None and connection.connected.is_set()

    async def connection(self, *, timeout_s: float | None = None, retry: bool = True) -> AbstractConnection:
        """The live connection, connecting again first if it was lost (each failure logged, then retried
        after a growing pause while ``retry``)."""
        connection = self._connection
        if connection is not None and connection.connected.is_set():
            return connection
        async with self._lock:
            pause_s = _RECONNECT_MIN_S
            while not self.connected:
                if self._closing:
                    raise ChannelLostError("the broker session is closing")
                try:
                    await self._connect(timeout_s or CALL_TIMEOUT_S)
                except BROKER_ERRORS as exc:
                    if not retry:
                        raise
                    log.warning("broker_reconnect_failed", error=type(exc).__name__, retry_in_s=pause_s)
                    await asyncio.sleep(pause_s)
                    pause_s = min(pause_s * 2, _RECONNECT_MAX_S)
            assert self._connection is not None
            return self._connection

    async def _connect(self, timeout_s: float) -> None:
        lost = self._connection
        if lost is not None:
            with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
                await lost.close()
        connection = await aio_pika.connect(
            self._url, client_properties={"connection_name": self._name}, timeout=timeout_s
        )
        connection.close_callbacks.add(self._on_lost)
        if lost is not None:
            RECONNECTS.inc()
            log.info("broker_reconnected")
        self._connection = connection
        CONNECTED.set(1)

    def _on_lost(self, _: object, exc: BaseException | None = None) -> None:
        CONNECTED.set(0)
        if not self._closing:
            log.warning(
                "broker_connection_lost", error=type(exc).__name__ if exc else None, detail=str(exc)[:200]
            )

    async def open_channel(self, *, confirms: bool = False, prefetch: int | None = None) -> AbstractChannel:
        """A new channel of the current connection, owned (and closed) by the caller. With ``confirms`` a
        publish waits for the broker's confirm and raises when it comes back unroutable."""
        connection = await self.connection()
        async with asyncio.timeout(CALL_TIMEOUT_S):
            channel = await connection.channel(publisher_confirms=confirms, on_return_raises=confirms)
            if prefetch is not None:
                await channel.set_qos(prefetch_count=prefetch)
        return channel

    @asynccontextmanager
    async def channel(
        self, *, confirms: bool = False, prefetch: int | None = None
    ) -> AsyncIterator[AbstractChannel]:
        """A channel for as long as the caller needs it, closed afterwards."""
        channel = await self.open_channel(confirms=confirms, prefetch=prefetch)
        try:
            yield channel
        finally:
            await close_quietly(channel)


async def close_quietly(channel: AbstractChannel) -> None:
    """Close a channel that may already be gone (with its connection) without raising."""
    if channel.is_closed:
        return
    with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
        async with asyncio.timeout(CALL_TIMEOUT_S):
            await channel.close()


async def until_closed(channel: AbstractChannel) -> None:
    """Wait while a consuming channel lives, then raise :class:`ChannelLostError`: the loop starts over."""
    await channel.closed()
    raise ChannelLostError("the channel closed")


async def on_cancel(channel: AbstractChannel, callback: Callable[[aiormq.spec.Basic.Cancel], None]) -> None:
    """Call ``callback`` when the broker cancels a consumer of this channel (its queue was deleted):
    the channel stays open, so without this a consumer could be gone without anyone noticing."""
    underlay = await channel.get_underlay_channel()
    assert isinstance(underlay, aiormq.Channel)
    underlay.on_consumer_cancel_callbacks.add(callback)


async def passive_queue(channel: AbstractChannel, name: str) -> AbstractQueue:
    """A queue that must exist (raises ``ChannelNotFoundEntity``, closing ``channel``, if it does not)."""
    return await channel.declare_queue(name, passive=True, timeout=CALL_TIMEOUT_S)


class QueueProbe:
    """Asks about queues that may not exist, with passive declares on a channel of its own. AMQP answers
    a missing queue with a channel error, so after a miss the channel is opened again for the next one."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self._channel: AbstractChannel | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def channel(self) -> AbstractChannel:
        """The probe's channel, also good for declaring what was found missing."""
        if self._channel is None or self._channel.is_closed:
            self._channel = await self._broker.open_channel()
        return self._channel

    async def find(self, name: str) -> AbstractQueue | None:
        channel = await self.channel()
        try:
            return await channel.declare_queue(name, passive=True, timeout=CALL_TIMEOUT_S)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            self._channel = None  # the failed declare closed it
            return None

    async def depth(self, name: str) -> int | None:
        """Ready messages in the queue; None when it does not exist."""
        queue = await self.find(name)
        return None if queue is None else queue.declaration_result.message_count or 0

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await close_quietly(channel)


class Publisher:
    """Publishes on a channel of its own, reopened after it is lost, each publish with a deadline.

    With ``confirms`` a publish returns only once the broker has the message (and raises when it was
    returned as unroutable); an error means the message may not have been taken: the caller answers
    503, retries, or hands its own message back, and never acks on the strength of it.
    """

    def __init__(self, broker: Broker, *, confirms: bool = True, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self._broker = broker
        self._confirms = confirms
        self._timeout_s = timeout_s
        self._channel: AbstractChannel | None = None
        self._exchanges: dict[str, AbstractExchange] = {}
        self._lock = asyncio.Lock()

    async def publish(
        self, message: aio_pika.Message, *, exchange: str, routing_key: str, timeout_s: float | None = None
    ) -> None:
        try:
            async with asyncio.timeout(timeout_s or self._timeout_s):
                target = await self._exchange(exchange)
                await target.publish(message, routing_key=routing_key)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our own cancellation (a shutdown): not the broker's doing
            # aiormq cancels the confirm it waits for when it drops a connection (missed heartbeats).
            raise ChannelLostError("the connection was lost before the broker confirmed") from None

    async def _exchange(self, name: str) -> AbstractExchange:
        channel = self._channel
        if channel is None or channel.is_closed:
            async with self._lock:
                channel = self._channel
                if channel is None or channel.is_closed:
                    channel = await self._broker.open_channel(confirms=self._confirms)
                    self._channel, self._exchanges = channel, {}
        exchange = self._exchanges.get(name)
        if exchange is None:
            # No declare: the topology exists; a missing exchange fails the publish (and the channel).
            exchange = (
                channel.default_exchange if name == "" else await channel.get_exchange(name, ensure=False)
            )
            self._exchanges[name] = exchange
        return exchange

    async def close(self) -> None:
        if self._channel is not None:
            await close_quietly(self._channel)
