"""The dispatcher process: follows the endpoint log, consumes every active endpoint's queue, and stops cleanly.

Any number of replicas run side by side; each consumes every endpoint queue (competing consumers),
with a per-endpoint prefetch so that one slow endpoint can hold at most that many of a replica's
deliveries.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from functools import partial

import structlog
from aio_pika.abc import (
    AbstractIncomingMessage,
    AbstractRobustChannel,
    AbstractRobustConnection,
    AbstractRobustQueue,
)
from pydantic import ValidationError

from hookline.dispatcher import metrics
from hookline.dispatcher.delays import Delays
from hookline.dispatcher.handler import USER_AGENT, Handler, handle_safely
from hookline.dispatcher.telemetry import Telemetry
from hookline.shared import amqp, lifecycle, registry, topology
from hookline.shared import logging as hookline_logging
from hookline.shared.control import BreakerState, BreakerView, control_record
from hookline.shared.delivery import DeliveryClient
from hookline.shared.models import EndpointStatus, StoredEndpoint, error_summary
from hookline.shared.registry import ChangeLog, EndpointRegistry
from hookline.shared.sealing import SealedSecretError, Sealer
from hookline.shared.settings import DispatcherSettings, load
from hookline.shared.streams import StreamFollower

log = structlog.get_logger(__name__)

PROBE_POLL_S = 1.0
RECONCILE_RETRY_S = 2.0
BREAKER_LOOKBACK = timedelta(minutes=2)


def _check_secrets_open(endpoint_registry: EndpointRegistry, sealer: Sealer) -> None:
    """A missing or wrong HOOKLINE_SECRET_KEY stops the dispatcher at start, rather than at every delivery."""
    for endpoint in endpoint_registry.all():
        try:
            sealer.open(endpoint.secrets[0].value)
        except SealedSecretError as exc:
            log.error("secret_key_unusable", endpoint_id=endpoint.id, detail=str(exc))
            raise SystemExit(1) from None


def _apply_control(breakers: BreakerView, consumers: Consumers, message: AbstractIncomingMessage) -> None:
    try:
        record = control_record.validate_json(message.body)
    except ValidationError as exc:
        log.error("control_record_unreadable", error=error_summary(exc))
        return
    consumers.on_breakers(breakers.apply(record))


class Consumers:
    """Keeps one consumer per endpoint that is active and whose breaker is closed, following the
    registry and the breaker commands. Changes are applied one at a time by a single task, so a quick
    create-then-delete can never leave a consumer behind."""

    def __init__(
        self,
        connection: AbstractRobustConnection,
        channel: AbstractRobustChannel,
        prefetch: int,
        registry: EndpointRegistry,
        breakers: BreakerView,
        handler: Handler,
        dispatcher_id: str,
    ) -> None:
        self._channel = channel
        self._connection = connection
        self._default_prefetch = prefetch
        self._registry = registry
        self._breakers = breakers
        self._handler = handler
        self._dispatcher_id = dispatcher_id
        self._active: dict[str, tuple[AbstractRobustQueue, str, int]] = {}  # queue, consumer tag, prefetch
        self._channels: dict[int, AbstractRobustChannel] = {prefetch: channel}  # one per prefetch value
        self._probes: dict[str, int] = {}  # endpoint id -> the half-open version being probed
        self._changed: asyncio.Queue[str | None] = asyncio.Queue()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False

    def on_change(self, before: StoredEndpoint | None, after: StoredEndpoint | None) -> None:
        endpoint_id = (after or before).id  # type: ignore[union-attr]
        self._changed.put_nowait(endpoint_id)

    def on_breakers(self, endpoint_ids: set[str]) -> None:
        for endpoint_id in endpoint_ids:
            self._changed.put_nowait(endpoint_id)

    async def run(self) -> None:
        """Apply changes until :meth:`stop_intake`. Never cancelled mid-way: aiormq closes a channel
        whose RPC is cancelled."""
        for endpoint in self._registry.all():
            await self._reconcile_or_retry(endpoint.id)
        while (endpoint_id := await self._changed.get()) is not None:
            await self._reconcile_or_retry(endpoint_id)

    async def _reconcile_or_retry(self, endpoint_id: str) -> None:
        try:
            await self._reconcile(endpoint_id)
        except amqp.BROKER_ERRORS as exc:
            # The channel is reconnecting (or refused something): try this endpoint again shortly.
            log.warning("consumer_reconcile_failed", endpoint_id=endpoint_id, error=type(exc).__name__)
            asyncio.get_running_loop().call_later(RECONCILE_RETRY_S, self._changed.put_nowait, endpoint_id)

    async def _reconcile(self, endpoint_id: str) -> None:
        endpoint = self._registry.get(endpoint_id)
        active = (
            endpoint is not None
            and endpoint.status is EndpointStatus.ACTIVE
            and endpoint.verified
            and not self._stopping
        )
        breaker = self._breakers.state(endpoint_id)
        wanted = active and breaker is None
        prefetch = self._prefetch(endpoint) if endpoint is not None else 0
        current = self._active.get(endpoint_id)
        if current is not None and (not wanted or current[2] != prefetch):
            # Breaker open, endpoint paused or gone, or its cap changed: stop here; what is queued waits.
            del self._active[endpoint_id]
            await current[0].cancel(current[1])
            current = None
        if wanted and current is None:
            assert endpoint is not None
            channel = await self._channel_for(prefetch)
            queue = await topology.endpoint_queue_declare(
                channel, endpoint_id, single_consumer=endpoint.single_consumer
            )
            # Idempotent; endpoints registered before the delay queues existed get their binding here.
            await queue.bind(topology.DELAY_DELIVERY, routing_key=topology.delay_delivery_binding(queue.name))
            tag = await queue.consume(partial(self._on_message, endpoint_id))
            self._active[endpoint_id] = (queue, tag, prefetch)
        if (
            active
            and breaker is not None
            and breaker.state is BreakerState.HALF_OPEN
            and breaker.probe_by == self._dispatcher_id
            and self._probes.get(endpoint_id) != breaker.version
        ):
            self._probes[endpoint_id] = breaker.version
            probe = asyncio.create_task(
                self._probe(endpoint_id, breaker.version), name=f"probe:{endpoint_id}"
            )
            self._tasks.add(probe)
            probe.add_done_callback(self._tasks.discard)
        metrics.CONSUMERS.set(len(self._active))

    def _prefetch(self, endpoint: StoredEndpoint) -> int:
        """Unacked deliveries this dispatcher may hold for the endpoint: for a capped endpoint (served by
        one dispatcher at a time) its ``max_in_flight``, and no more than 10 s of its rate limit."""
        prefetch = endpoint.max_in_flight or self._default_prefetch
        if endpoint.rate_limit_per_s is not None:
            prefetch = min(prefetch, max(1, math.ceil(endpoint.rate_limit_per_s * 10)))
        return prefetch

    async def _channel_for(self, prefetch: int) -> AbstractRobustChannel:
        # basic.qos applies to the consumers created after it, and a robust channel restores only its
        # last qos after a reconnect: one channel per prefetch value keeps every consumer's cap right.
        channel = self._channels.get(prefetch)
        if channel is None:
            channel = await self._connection.channel()
            await channel.set_qos(prefetch_count=prefetch)
            self._channels[prefetch] = channel
        return channel

    async def close_channels(self) -> None:
        for channel in self._channels.values():
            with contextlib.suppress(*amqp.BROKER_ERRORS):
                await channel.close()

    async def _probe(self, endpoint_id: str, version: int) -> None:
        """Deliver exactly one message while the breaker is half open and this replica is the prober."""

        def still_mine() -> bool:
            command = self._breakers.state(endpoint_id)
            return not self._stopping and command is not None and command.version == version

        queue = await self._channel.get_queue(topology.endpoint_queue(endpoint_id), ensure=False)
        while still_mine():
            try:
                message = await queue.get(no_ack=False, fail=False)
            except amqp.BROKER_ERRORS as exc:
                log.warning("breaker_probe_get_failed", endpoint_id=endpoint_id, error=type(exc).__name__)
                message = None
            if message is None:
                await asyncio.sleep(PROBE_POLL_S)  # nothing to probe with yet, or the channel is back soon
                continue
            log.info("breaker_probe", endpoint_id=endpoint_id, version=version)
            if await handle_safely(self._handler, endpoint_id, message, probe=True):
                return
            # No attempt came of it (an invalid event, a deferral, a failure): probe with the next one.

    async def _on_message(self, endpoint_id: str, message: AbstractIncomingMessage) -> None:
        await self.track(partial(handle_safely, self._handler, endpoint_id), message)

    async def track(
        self, handle: Callable[[AbstractIncomingMessage], Awaitable[object]], message: AbstractIncomingMessage
    ) -> None:
        """Run a message's handling as a task the shutdown drain waits for."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await handle(message)
        finally:
            self._tasks.discard(task)

    @property
    def consuming(self) -> int:
        return len(self._active)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def stop_intake(self, reconciler: asyncio.Task[None]) -> None:
        """Cancel every consumer: the broker sends nothing more; what was delivered is still ours."""
        self._stopping = True
        self._changed.put_nowait(None)
        await reconciler
        for queue, tag, _ in self._active.values():
            # A channel already gone has stopped delivering anyway.
            with contextlib.suppress(*amqp.BROKER_ERRORS):
                await queue.cancel(tag)
        self._active.clear()

    async def drain(self, grace_s: float) -> int:
        """Wait up to ``grace_s`` for in-flight deliveries; cancel the rest. Returns how many were cancelled.

        A cancelled delivery's message stays unacked, so the broker redelivers it when the channel closes.
        """
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        leftovers = set(self._tasks)
        for task in leftovers:
            task.cancel()
        if leftovers:
            await asyncio.wait(leftovers, timeout=5)
        return len(leftovers)


@asynccontextmanager
async def dispatching(
    settings: DispatcherSettings,
    connection: AbstractRobustConnection,
    change_log: ChangeLog,
    client: DeliveryClient,
) -> AsyncIterator[Consumers]:
    endpoint_registry = change_log.registry
    sealer = Sealer(settings.secret_key.get_secret_value() if settings.secret_key else None)
    _check_secrets_open(endpoint_registry, sealer)
    publisher = await connection.channel(publisher_confirms=True, on_return_raises=True)
    consumer_channel = await connection.channel()
    # Per consumer (global_=False): each endpoint gets its own window of unacked deliveries.
    await consumer_channel.set_qos(prefetch_count=settings.prefetch_per_endpoint)
    # Telemetry goes out unconfirmed on a channel of its own: never a wait on the delivery path.
    telemetry_channel = await connection.channel(publisher_confirms=False)
    dispatcher_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    consumers_ref: list[Consumers] = []
    telemetry = Telemetry(
        await telemetry_channel.get_exchange(topology.TELEMETRY_EXCHANGE, ensure=False),
        dispatcher_id,
        load=lambda: (consumers_ref[0].in_flight, consumers_ref[0].consuming) if consumers_ref else (0, 0),
    )
    breakers = BreakerView()
    handler = Handler(
        settings,
        endpoint_registry,
        change_log,
        client,
        await topology.dead_letter_exchange(publisher),
        await Delays.open(publisher),
        telemetry,
        breakers,
        sealer,
    )
    consumers = Consumers(
        connection,
        consumer_channel,
        settings.prefetch_per_endpoint,
        endpoint_registry,
        breakers,
        handler,
        dispatcher_id,
    )
    consumers_ref.append(consumers)
    # The breaker states in force: the monitor snapshots them every few seconds, so reading the last
    # minutes of its log gives the current state, then the follower keeps up with changes.
    control = StreamFollower(
        connection,
        topology.BREAKER_LOG,
        lambda message: _apply_control(breakers, consumers, message),
        start=datetime.now(UTC) - BREAKER_LOOKBACK,
        prefetch=100,
    )
    await control.start()
    await control.sync(timeout_s=settings.connect_timeout_s)
    endpoint_registry.subscribe(consumers.on_change)
    reconciler = asyncio.create_task(consumers.run(), name="consumers")
    telemetry_task = asyncio.create_task(telemetry.run(), name="telemetry")
    # Retries whose endpoint queue is gone: any replica turns them into dead letters.
    unroutable = await consumer_channel.declare_queue(topology.DELAY_UNROUTABLE, passive=True)
    unroutable_tag = await unroutable.consume(partial(consumers.track, handler.handle_unroutable))
    try:
        yield consumers
    finally:
        # Shutdown, in order:
        # 1. stop taking work, so the drain below can finish;
        with contextlib.suppress(*amqp.BROKER_ERRORS):
            await unroutable.cancel(unroutable_tag)
        await consumers.stop_intake(reconciler)
        # 2. let in-flight deliveries finish and settle within the grace period;
        cancelled = await consumers.drain(settings.shutdown_grace_s)
        log.info("dispatcher_drained", cancelled=cancelled)
        telemetry_task.cancel()  # its last flush runs in its finally
        await asyncio.gather(telemetry_task, return_exceptions=True)
        await control.stop()
        # 3. close the channels: whatever is still unacked goes back to its queue.
        await consumers.close_channels()
        for channel in (publisher, telemetry_channel):
            with contextlib.suppress(*amqp.BROKER_ERRORS):
                await channel.close()


def main() -> None:
    settings = load(DispatcherSettings)
    hookline_logging.configure(service="dispatcher", level=settings.log_level)

    async def run() -> None:
        await serve(settings, lifecycle.stop_event())

    lifecycle.run(run)


async def serve(settings: DispatcherSettings, stopping: asyncio.Event) -> None:
    """Run one dispatcher until ``stopping`` is set, then shut down in order (see :func:`dispatching`)."""
    endpoint_registry = EndpointRegistry()
    async with (
        amqp.connection(
            settings.amqp_url, name="hookline-dispatcher", connect_timeout_s=settings.connect_timeout_s
        ) as connection,
        DeliveryClient(
            max_connections=settings.http_max_connections,
            user_agent=USER_AGENT,
            allow_http=settings.allow_http,
            allow_private=settings.allow_private_targets,
        ) as client,
    ):
        await topology.declare(connection, event_log_max_age_s=settings.event_log_max_age_s)
        async with (
            registry.follow(
                connection, endpoint_registry, sync_timeout_s=settings.connect_timeout_s
            ) as change_log,
            dispatching(settings, connection, change_log, client) as consumers,
            metrics.probe_server(
                settings.dispatcher_metrics_host,
                settings.dispatcher_metrics_port,
                is_ready=lambda: not connection.is_closed,
            ),
        ):
            log.info("dispatcher_ready", endpoints=len(endpoint_registry))
            await stopping.wait()
            log.info("dispatcher_stopping", consuming=consumers.consuming)
    log.info("dispatcher_stopped")
