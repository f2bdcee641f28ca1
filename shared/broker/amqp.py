"""The broker session every service holds: a connection for consuming and one for publishing, each
reopened whenever it is lost, the channels its loops open from them, and publishing with a deadline.

Nothing here is "robust" in aio-pika's sense, on purpose: a robust connection restores queues,
bindings and consumers behind the code's back (a deleted endpoint's queue comes back, a queue restored
with stale arguments fails the whole recovery, a consumer lost to a channel error is never noticed).
Instead each loop owns its channels: when the connection or a channel goes, the loop's body raises,
its supervisor (:mod:`hookline.shared.runtime.supervision`) runs it again, and it declares and consumes afresh
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
from urllib.parse import parse_qsl, unquote, urlsplit

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
#: How often an idle publishing connection publishes to learn of alarms, and ``unblocked`` looks again.
PULSE_INTERVAL_S = 1.0
_UNBLOCKED_POLL_S = 1.0
#: The pulse's routing key on the default exchange: no queue has this name, and the pulse is not
#: mandatory, so the broker drops it without a word.
PULSE_ROUTE = "hookline.pulse"

RECONNECTS = prometheus_client.Counter(
    "hookline_broker_reconnects", "Times this process connected to the broker again after losing it."
)
CONNECTED = prometheus_client.Gauge("hookline_broker_connected", "1 while connected to the broker.")
BLOCKED = prometheus_client.Gauge(
    "hookline_broker_blocked", "1 while the broker refuses this process's publishes (memory or disk alarm)."
)
BLOCKED_SECONDS = prometheus_client.Counter(
    "hookline_broker_blocked_seconds", "Time the broker refused this process's publishes."
)
NACKED_CHANNELS_REOPENED = prometheus_client.Counter(
    "hookline_publish_channels_reopened", "Publishing channels replaced after the broker nacked a publish."
)
PUBLISHES_REFUSED = prometheus_client.Counter(
    "hookline_publishes_refused", "Publishes refused at once because the broker was blocking publishes."
)


class ChannelLostError(ConnectionError):
    """A channel a loop was using has closed (the connection went, or the broker closed the channel)."""


class BrokerBlockedError(ConnectionError):
    """The broker refuses publishes for now (a memory or disk alarm: ``connection.blocked``)."""


class _Link:
    """One AMQP connection, reopened on demand after a loss (each failure logged, then retried after a
    growing pause while ``retry``)."""

    def __init__(self, urls: list[str], name: str) -> None:
        self._urls = urls
        self._next = 0  # the address that worked last is tried first
        self.name = name
        self._connection: AbstractConnection | None = None
        self.unblocked_event: asyncio.Event | None = None  # set unless connection.blocked
        self._lock = asyncio.Lock()
        self.closing = False

    @property
    def connected(self) -> bool:
        connection = self._connection
        return connection is not None and connection.connected.is_set()

    @property
    def blocked(self) -> bool:
        return self.connected and self.unblocked_event is not None and not self.unblocked_event.is_set()

    async def connection(self, *, timeout_s: float | None = None, retry: bool = True) -> AbstractConnection:
        connection = self._connection
        if connection is not None and connection.connected.is_set():
            return connection
        async with self._lock:
            pause_s = _RECONNECT_MIN_S
            while not self.connected:
                if self.closing:
                    raise ChannelLostError("the broker session is closing")
                try:
                    await self._connect(timeout_s or CALL_TIMEOUT_S)
                except BROKER_ERRORS as exc:
                    if not retry:
                        raise
                    log.warning(
                        "broker_reconnect_failed",
                        connection=self.name,
                        error=type(exc).__name__,
                        retry_in_s=pause_s,
                    )
                    await asyncio.sleep(pause_s)
                    pause_s = min(pause_s * 2, _RECONNECT_MAX_S)
            assert self._connection is not None
            return self._connection

    async def _connect(self, timeout_s: float) -> None:
        lost = self._connection
        if lost is not None:
            # Bounded: this runs under the link's lock, and every caller waits on it.
            with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    await lost.close()
        connection = await self._first_answering(timeout_s)
        connection.close_callbacks.add(self._on_lost)
        if lost is not None:
            RECONNECTS.inc()
            log.info("broker_reconnected", connection=self.name, node=_address(self._urls[self._next]))
        self._connection, self.unblocked_event = connection, _unblocked_event(connection)

    async def _first_answering(self, timeout_s: float) -> AbstractConnection:
        """The broker addresses in turn (a cluster's nodes), from the one that answered last."""
        failure: BaseException | None = None
        for step in range(len(self._urls)):
            index = (self._next + step) % len(self._urls)
            try:
                connection = await aio_pika.connect(
                    self._urls[index], client_properties={"connection_name": self.name}, timeout=timeout_s
                )
            except BROKER_ERRORS as exc:
                failure = exc
                if len(self._urls) > 1:
                    log.warning(
                        "broker_node_unreachable", node=_address(self._urls[index]), error=type(exc).__name__
                    )
                continue
            self._next = index
            return connection
        assert failure is not None
        raise failure

    def _on_lost(self, _: object, exc: BaseException | None = None) -> None:
        if not self.closing:
            log.warning(
                "broker_connection_lost",
                connection=self.name,
                error=type(exc).__name__ if exc else None,
                detail=str(exc)[:200],
            )

    async def close(self) -> None:
        self.closing = True
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(*BROKER_ERRORS, RuntimeError):
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    await connection.close()


def broker_urls(setting: str) -> list[str]:
    """``HOOKLINE_AMQP_URL``: one address, or a cluster's, comma separated (tried in turn)."""
    return [url.strip() for url in setting.split(",") if url.strip()]


def _address(url: str) -> str:
    """host:port of a broker URL, without its credentials: safe to log."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or (5671 if parts.scheme == 'amqps' else 5672)}"


def _unblocked_event(connection: AbstractConnection) -> asyncio.Event | None:
    """aiormq follows ``connection.blocked``/``unblocked`` in a private event and offers no callback or
    property (reference/control-plane-techniques.md §4); this is the one place that reads it."""
    underlay = connection.transport.connection if connection.transport is not None else None
    event = getattr(underlay, "_Connection__connection_unblocked", None)
    if not isinstance(event, asyncio.Event):
        log.warning("broker_blocked_undetectable", detail="this aiormq does not expose connection.blocked")
        return None
    return event


def _dropped_by_aiormq() -> bool:
    """Whether the CancelledError being handled is aiormq's rather than this task's own (a shutdown):
    when aiormq drops a connection (missed heartbeats) it cancels whatever waits on it, a channel being
    opened or a confirm, and the waiter sees a CancelledError although nobody cancelled its task."""
    task = asyncio.current_task()
    return task is None or not task.cancelling()


def _with_heartbeat(url: str) -> str:
    if "heartbeat" in dict(parse_qsl(urlsplit(url).query)):
        return url
    return url + ("&" if urlsplit(url).query else "?") + f"heartbeat={DEFAULT_HEARTBEAT_S}"


async def _unbounded_frames(channel: AbstractChannel) -> None:
    """aiormq hands each channel's frames from the connection's reader to the channel's own through a
    queue of 10, and aio-pika offers no way to choose another size: whenever one channel's queue is
    full, the connection's reader waits, so every channel of the connection gets about three deliveries
    (or ten confirms) a turn of the event loop, and the rest wait unread in the socket. Under a burst
    that is the whole delay of a lane with one event in it: measured with ``bench/burst.py``, a trickle
    in another lane than a 10,000-event burst took p99 1.3-1.5 s from publish to delivery, all of it
    before the dispatcher's consumer saw the message (a bare consumer beside it: 30 ms); unbounded,
    p99 361-556 ms. The broker bounds what reaches a channel (its consumers' prefetch, a publisher's
    unconfirmed publishes), so the queue need not. (``maxsize`` has no setter; the attribute behind it
    is what ``asyncio.Queue.full`` reads: ``tests/integration/test_broker_channels.py`` fails if that changes.)"""
    frames = (await channel.get_underlay_channel()).frames
    assert isinstance(frames, asyncio.Queue)
    frames._maxsize = 0  # type: ignore[attr-defined]


class Broker:
    """The process's broker session: a connection for consuming and administration, and one for
    publishing, each opened at start (or the service exits) and reopened on demand after a loss.

    Publishing has a connection of its own because a memory or disk alarm blocks a connection as soon as
    it publishes: the broker then stops reading it, acks included. Consumers on the other connection go
    on delivering and acking while publishes wait. A connection hears of an alarm only when it publishes,
    so an idle publishing connection sends an empty, unroutable message every second: ``blocked`` turns
    true within about a second of an alarm, before anything that matters waits on it.

    ``async with Broker(url, name=..., connect_timeout_s=...) as broker`` — a broker that cannot be
    reached within ``connect_timeout_s`` at start stops the service (exit 1); later losses are retried
    for as long as the service runs, with a backoff, by whichever loop needs the connection first.
    """

    def __init__(self, url: str, *, name: str, connect_timeout_s: float, pulse: bool = True) -> None:
        self._connect_timeout_s = connect_timeout_s
        # Without it (an upstream's user may write to events only, not to the default exchange), an
        # alarm is known at the next publish, which then fails after its deadline.
        self._pulsing = pulse
        urls = [_with_heartbeat(address) for address in broker_urls(url)]
        self._consuming = _Link(urls, f"{name}:{os.getpid()}")
        self._publishing = _Link(urls, f"{name}:{os.getpid()}:publish")
        self._last_publish_s = 0.0
        self._blocked_since_s: float | None = None
        self._pulse: asyncio.Task[None] | None = None
        self.vhost = urlsplit(urls[0]).path.lstrip("/") or "/"
        # Who this session connects as: set as the user_id of what it writes, which RabbitMQ checks.
        self.user = unquote(urlsplit(urls[0]).username or "guest")

    async def __aenter__(self) -> Self:
        deadline = time.monotonic() + self._connect_timeout_s
        for link in (self._consuming, self._publishing):
            while True:
                try:
                    await link.connection(timeout_s=min(CALL_TIMEOUT_S, self._connect_timeout_s), retry=False)
                    break
                except BROKER_ERRORS as exc:
                    remaining_s = deadline - time.monotonic()
                    if remaining_s <= 0:
                        log.error("broker_unreachable", error=type(exc).__name__, detail=str(exc)[:300])
                        raise SystemExit(1) from None
                    log.warning(
                        "broker_connect_retry", error=type(exc).__name__, remaining_s=round(remaining_s, 1)
                    )
                    await asyncio.sleep(min(1.0, remaining_s))
        CONNECTED.set_function(lambda: int(self.connected))
        BLOCKED.set_function(lambda: int(self.blocked))
        if self._pulsing:
            self._pulse = asyncio.create_task(self._keep_pulse(), name="broker-pulse")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._pulse is not None:
            self._pulse.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pulse
        # Publishes first: whatever is still being confirmed has had its chance by now.
        await self._publishing.close()
        await self._consuming.close()

    @property
    def connected(self) -> bool:
        return self._consuming.connected

    @property
    def publishing_connected(self) -> bool:
        """The publishing connection is up (a process that only publishes never opens the other again)."""
        return self._publishing.connected

    @property
    def blocked(self) -> bool:
        """True while the broker refuses this process's publishes (a memory or disk alarm)."""
        return self._publishing.blocked

    def problems(self) -> list[str]:
        """What keeps this process from using the broker, for ``/readyz``."""
        if not self.connected:
            return ["broker: not connected"]
        if self.blocked:
            since_s = self._blocked_since_s
            blocked_s = 0.0 if since_s is None else time.monotonic() - since_s
            return [f"broker: refusing publishes for {blocked_s:.0f} s (a memory or disk alarm)"]
        return []

    async def unblocked(self) -> None:
        """Return once the broker takes publishes again (at once when it does now)."""
        while self.blocked:
            event = self._publishing.unblocked_event
            assert event is not None  # blocked implies a known event
            # Bounded, and looked at again: a connection lost meanwhile comes back with another event.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_UNBLOCKED_POLL_S):
                    await event.wait()

    async def connection(self, *, timeout_s: float | None = None, retry: bool = True) -> AbstractConnection:
        """The live consuming connection, connecting again first if it was lost."""
        return await self._consuming.connection(timeout_s=timeout_s, retry=retry)

    async def open_channel(
        self, *, confirms: bool = False, prefetch: int | None = None, publishing: bool = False
    ) -> AbstractChannel:
        """A new channel, owned (and closed) by the caller: of the publishing connection when
        ``publishing``, else of the consuming one. With ``confirms`` a publish waits for the broker's
        confirm and raises when it comes back unroutable."""
        link = self._publishing if publishing else self._consuming
        connection = await link.connection()
        async with asyncio.timeout(CALL_TIMEOUT_S):
            try:
                channel = await connection.channel(publisher_confirms=confirms, on_return_raises=confirms)
            except RuntimeError as exc:
                # aio_pika's word for a connection that closed between our look and the call ("was not
                # opened", "closed channel"): a lost connection like any other, so that every caller's
                # BROKER_ERRORS handling (retry once connected again) covers it.
                raise ChannelLostError(f"the broker connection closed: {exc}") from exc
            try:
                await _unbounded_frames(channel)
                if prefetch is not None:
                    await channel.set_qos(prefetch_count=prefetch)
            except BaseException:  # half set up: nobody else would close it
                await close_quietly(channel)
                raise
        return channel

    @asynccontextmanager
    async def channel(
        self, *, confirms: bool = False, prefetch: int | None = None
    ) -> AsyncIterator[AbstractChannel]:
        """A channel of the consuming connection for as long as the caller needs it, closed afterwards."""
        channel = await self.open_channel(confirms=confirms, prefetch=prefetch)
        try:
            yield channel
        finally:
            await close_quietly(channel)

    def published(self) -> None:
        """Something was just published: no pulse is needed for a second."""
        self._last_publish_s = time.monotonic()

    async def _keep_pulse(self) -> None:
        channel: AbstractChannel | None = None
        try:
            while True:
                self._note_blocked()
                idle = time.monotonic() - self._last_publish_s >= PULSE_INTERVAL_S
                if idle and not self.blocked:
                    try:
                        if channel is None or channel.is_closed:
                            channel = await self.open_channel(publishing=True)
                        async with asyncio.timeout(CALL_TIMEOUT_S):
                            await channel.default_exchange.publish(
                                aio_pika.Message(b""), routing_key=PULSE_ROUTE, mandatory=False
                            )
                    except BROKER_ERRORS:
                        channel = None  # the link is reopened by the next pulse
                    except asyncio.CancelledError:
                        if not _dropped_by_aiormq():
                            raise
                        channel = None  # as above: the pulse is what brings an idle link back
                    except Exception as exc:
                        # Whatever a lost connection raises, the pulse must outlive it: a process that
                        # seldom publishes (a standby monitor, an ingest fed over AMQP) has no other way back.
                        log.warning("broker_pulse_failed", error=type(exc).__name__, detail=str(exc)[:200])
                        channel = None
                await asyncio.sleep(PULSE_INTERVAL_S)
        finally:
            if channel is not None:
                await close_quietly(channel)

    def _note_blocked(self) -> None:
        """One log line when the broker starts refusing publishes and one when it takes them again."""
        if self.blocked and self._blocked_since_s is None:
            self._blocked_since_s = time.monotonic()
            log.error("broker_blocked", connection=self._publishing.name, alert=True)
        elif not self.blocked and self._blocked_since_s is not None:
            blocked_s = time.monotonic() - self._blocked_since_s
            self._blocked_since_s = None
            BLOCKED_SECONDS.inc(blocked_s)
            log.warning("broker_unblocked", connection=self._publishing.name, blocked_s=round(blocked_s, 1))


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
        self._opening = asyncio.Lock()  # callers that ask at once share one new channel

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def channel(self) -> AbstractChannel:
        """The probe's channel, also good for declaring what was found missing."""
        async with self._opening:
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
    """Publishes on a channel of its own of the publishing connection, reopened after it is lost, each
    publish with a deadline.

    With ``confirms`` a publish returns only once the broker has the message (and raises when it was
    returned as unroutable); an error means the message may not have been taken: the caller answers
    503, retries, or hands its own message back, and never acks on the strength of it. While the broker
    refuses publishes (an alarm), a publish raises :class:`BrokerBlockedError` at once, or with
    ``wait_unblocked`` waits for as long as the alarm lasts before its deadline starts.
    """

    def __init__(
        self,
        broker: Broker,
        *,
        confirms: bool = True,
        timeout_s: float = CALL_TIMEOUT_S,
        wait_unblocked: bool = False,
    ) -> None:
        self._broker = broker
        self._confirms = confirms
        self._timeout_s = timeout_s
        self._wait_unblocked = wait_unblocked
        self._channel: AbstractChannel | None = None
        self._exchanges: dict[str, AbstractExchange] = {}
        self._lock = asyncio.Lock()

    async def publish(
        self,
        message: aio_pika.Message,
        *,
        exchange: str,
        routing_key: str,
        timeout_s: float | None = None,
    ) -> None:
        if self._broker.blocked:
            if not self._wait_unblocked:
                PUBLISHES_REFUSED.inc()
                raise BrokerBlockedError("the broker refuses publishes for now (a memory or disk alarm)")
            await self._broker.unblocked()
        channel = None
        try:
            async with asyncio.timeout(timeout_s or self._timeout_s):
                target = await self._exchange(exchange)
                channel = self._channel  # the one _exchange just used (no await in between)
                self._broker.published()
                await target.publish(message, routing_key=routing_key)
        except aiormq.exceptions.DeliveryError as exc:
            if isinstance(exc.frame, aiormq.spec.Basic.Nack) and channel is not None:
                await self._discard(channel)
            raise
        except asyncio.CancelledError:
            if not _dropped_by_aiormq():
                raise
            raise ChannelLostError("the connection was lost before the broker confirmed") from None

    async def open(self, exchange: str) -> None:
        """Open the channel (and the connection under it) now rather than at the next publish: a
        process that publishes seldom then notices a lost broker, and comes back, while idle."""
        await self._exchange(exchange)

    async def _discard(self, channel: AbstractChannel) -> None:
        """A nack: the next publish gets a channel of its own. (RabbitMQ 3.10 measured: after a cluster
        node dies, a channel that published to a stream whose leader was there goes on being nacked for
        about 15 s, while a new channel's publishes are confirmed at once.)"""
        async with self._lock:
            if self._channel is not channel:
                return  # another publish's nack already did
            self._channel, self._exchanges = None, {}
        NACKED_CHANNELS_REOPENED.inc()
        await close_quietly(channel)

    async def _exchange(self, name: str) -> AbstractExchange:
        channel = self._channel
        if channel is None or channel.is_closed:
            async with self._lock:
                channel = self._channel
                if channel is None or channel.is_closed:
                    channel = await self._broker.open_channel(confirms=self._confirms, publishing=True)
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
