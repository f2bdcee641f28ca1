"""A dispatcher at work, given its broker session, change log and HTTP client: the handler and the
consumers assembled (the side publishers, tracing and transform workers they use), the breaker states
in force read before anything is consumed, its loops spawned, and the shutdown in order: intake
stopped, in-flight deliveries drained, the last telemetry, the channels closed."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial

import structlog
from pydantic import ValidationError

from hookline.dispatcher import consumed, metrics
from hookline.dispatcher.admission import Share
from hookline.dispatcher.breakers import expire_breakers
from hookline.dispatcher.brokercheck import check_consumers
from hookline.dispatcher.consumers import Consumers
from hookline.dispatcher.handler import Handler
from hookline.dispatcher.lag import LagProbe
from hookline.dispatcher.ownqueues import refit_prefetch
from hookline.dispatcher.reporting import Telemetry
from hookline.dispatcher.settings import DispatcherSettings
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import CALL_TIMEOUT_S, Broker, Publisher, passive_queue, until_closed
from hookline.shared.broker.isolation import Isolation
from hookline.shared.broker.streams import Record, StreamFollower, follow_synced
from hookline.shared.contracts.control import BREAKER_LOOKBACK, BreakerView, control_record
from hookline.shared.contracts.models import error_summary
from hookline.shared.outbound.delivery import DeliveryClient
from hookline.shared.outbound.sealing import SealedSecretError, Sealer
from hookline.shared.outbound.transforms import Transformer
from hookline.shared.runtime.supervision import Loop, Supervisor
from hookline.shared.runtime.tracing import Tracing
from hookline.shared.state.registry import ChangeLog, EndpointRegistry

log = structlog.get_logger(__name__)

#: Transform worker processes per dispatcher, started at its first transform (each about 30 MiB).
TRANSFORM_WORKERS = 2


#: Endpoints whose secret is opened at start to check HOOKLINE_SECRET_KEY.
SECRETS_CHECKED = 100


def _check_secrets_open(endpoint_registry: EndpointRegistry, sealer: Sealer) -> None:
    """A missing or wrong HOOKLINE_SECRET_KEY stops the dispatcher at start, rather than at every delivery."""
    # The first endpoints stand for all (one key seals every secret); a million need not be opened.
    for endpoint in itertools.islice(endpoint_registry.rows.every(), SECRETS_CHECKED):
        try:
            sealer.open(endpoint.secrets[0].value)
        except SealedSecretError as exc:
            log.error("secret_key_unusable", endpoint_id=endpoint.id, detail=str(exc))
            raise SystemExit(1) from None


def _apply_control(breakers: BreakerView, consumers: Consumers, message: Record) -> None:
    try:
        record = control_record.validate_json(message.body)
    except ValidationError as exc:
        log.error("control_record_unreadable", error=error_summary(exc))
        return
    consumers.changes.on_breakers(breakers.apply(record, now_s=time.monotonic()))


async def _consume_unroutable(broker: Broker, consumers: Consumers, handler: Handler, loop: Loop) -> None:
    """Retries whose endpoint is gone: any replica turns them into dead letters."""
    async with broker.channel(prefetch=32) as channel:
        await passive_queue(channel, topology.DELAY_UNROUTABLE)
        await consumed.consume(
            channel,
            topology.DELAY_UNROUTABLE,
            partial(consumers.handling.track, "", handler.forwarding.handle_unroutable),
            timeout_s=CALL_TIMEOUT_S,
        )
        loop.mark_up()
        await until_closed(channel)


@dataclass(frozen=True)
class _SidePublishers:
    """The dispatcher's publishers besides the one it shares with the change log, each with a channel
    of its own so that neither waits behind the other."""

    # Unconfirmed: telemetry is never a wait on the delivery path.
    telemetry: Publisher
    # Retries, dead letters and forwards: while the broker refuses publishes (an alarm) they wait, and
    # the message they settle stays unacked meanwhile; deliveries that succeed need no publish.
    settlement: Publisher


@asynccontextmanager
async def _side_publishers(broker: Broker) -> AsyncIterator[_SidePublishers]:
    publishers = _SidePublishers(
        telemetry=Publisher(broker, confirms=False), settlement=Publisher(broker, wait_unblocked=True)
    )
    try:
        yield publishers
    finally:
        await publishers.telemetry.close()
        await publishers.settlement.close()


@asynccontextmanager
async def _tracing(settings: DispatcherSettings) -> AsyncIterator[Tracing]:
    tracing = Tracing("dispatcher", settings.otlp_endpoint)
    try:
        yield tracing
    finally:
        # The last spans, when traces are exported; in a thread, since the exporter blocks.
        await asyncio.to_thread(tracing.shutdown)


@dataclass(frozen=True)
class _Parts:
    breakers: BreakerView
    telemetry: Telemetry
    handler: Handler
    consumers: Consumers


def _assemble(
    settings: DispatcherSettings,
    broker: Broker,
    change_log: ChangeLog,
    client: DeliveryClient,
    sealer: Sealer,
    publishers: _SidePublishers,
    tracing: Tracing,
    transformer: Transformer,
) -> _Parts:
    """The handler and the consumers that feed it; nothing runs yet."""
    dispatcher_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    telemetry = Telemetry(publishers.telemetry, dispatcher_id)
    breakers = BreakerView(lease_s=settings.breaker_lease_s)
    isolation = Isolation(
        broker, change_log, max_queues=settings.max_endpoint_queues, timeout_s=settings.connect_timeout_s
    )
    handler = Handler(
        settings, change_log, client, publishers.settlement, telemetry, breakers, sealer,
        isolation=isolation, tracing=tracing, transformer=transformer,
    )  # fmt: skip
    consumers = Consumers(
        broker,
        change_log.registry,
        breakers,
        handler,
        dispatcher_id,
        default_prefetch=settings.prefetch_per_endpoint,
        lane_prefetch=settings.lane_prefetch,
        sync=partial(change_log.sync, timeout_s=settings.connect_timeout_s),
    )
    telemetry.load = consumers.load
    # How far this replica has read the change log, said at once when an endpoint changes (an ingest
    # waits for every replica before it answers a new endpoint).
    # -1: nothing applied yet (None would say "a version that does not tell", which nobody waits for).
    telemetry.applied_offset = lambda: -1 if change_log.applied_offset is None else change_log.applied_offset
    change_log.registry.subscribe(lambda _before, _after: telemetry.applied())
    metrics.IN_FLIGHT.set_function(lambda: consumers.handling.in_flight)
    metrics.CONSUMERS.set_function(lambda: consumers.consumer_count)
    metrics.UNACKED.set_function(consumers.handling.unacked)
    ledger = handler.admission.ledger
    for share in Share:
        metrics.SLOTS_IN_USE.labels(share.value).set_function(partial(ledger.in_use.__getitem__, share))
    metrics.SLOW_ENDPOINTS.set_function(lambda: ledger.slow_count)
    return _Parts(breakers, telemetry, handler, consumers)


async def _follow_breakers(
    settings: DispatcherSettings, broker: Broker, publisher: Publisher, supervisor: Supervisor, parts: _Parts
) -> None:
    """Return once the breaker states in force are known, so that no endpoint whose breaker is open is
    consumed at start. The monitor snapshots them every few seconds: reading the last minutes of its
    log gives the current state, then the follower keeps up with changes."""
    control = StreamFollower(
        broker,
        topology.BREAKER_LOG,
        partial(_apply_control, parts.breakers, parts.consumers),
        publisher=publisher,
        start=datetime.now(UTC) - BREAKER_LOOKBACK,
        prefetch=100,
    )
    await follow_synced(supervisor, "breakers", control, timeout_s=settings.connect_timeout_s)


@asynccontextmanager
async def dispatching(
    settings: DispatcherSettings,
    broker: Broker,
    supervisor: Supervisor,
    change_log: ChangeLog,
    publisher: Publisher,
    client: DeliveryClient,
    lag: LagProbe,
) -> AsyncIterator[Consumers]:
    sealer = Sealer(settings.secret_key.get_secret_value() if settings.secret_key else None)
    _check_secrets_open(change_log.registry, sealer)
    async with (
        _tracing(settings) as tracing,
        _side_publishers(broker) as publishers,
        Transformer(workers=TRANSFORM_WORKERS, max_bytes=settings.max_payload_bytes) as transformer,
    ):
        parts = _assemble(settings, broker, change_log, client, sealer, publishers, tracing, transformer)
        consumers = parts.consumers
        lag.listen(parts.handler.admission.loop_ran_late)
        await _follow_breakers(settings, broker, publisher, supervisor, parts)
        supervisor.spawn(
            "breaker-leases", partial(expire_breakers, parts.breakers, consumers.changes), stall_s=30
        )
        # Neither is needed for delivering (a replica without them is still ready).
        supervisor.spawn(
            "prefetch", partial(refit_prefetch, consumers.own_queues), required=False, stall_s=30
        )
        supervisor.spawn(
            "consumer-check",
            partial(check_consumers, consumers.check, settings.consumer_check_s),
            required=False,
        )
        change_log.registry.subscribe(consumers.changes.on_change)
        supervisor.spawn("telemetry", parts.telemetry.run, stall_s=30)
        supervisor.spawn("consumers", consumers.run)
        supervisor.spawn("unroutable", partial(_consume_unroutable, broker, consumers, parts.handler))
        try:
            yield consumers
        finally:
            # Shutdown, in order:
            # 1. stop taking work, so the drain below can finish;
            await consumers.stop_intake()
            await supervisor.stop("consumers", "unroutable", "breaker-leases", "prefetch", "consumer-check")
            # 2. let in-flight deliveries finish and settle within the grace period;
            cancelled = await consumers.handling.drain(settings.shutdown_grace_s)
            log.info("dispatcher_drained", cancelled=cancelled)
            # 3. the last telemetry (its final flush runs as it stops, with a heartbeat saying this
            #    replica is going: nobody waits for it to apply the change log any more), then the followers;
            parts.telemetry.stopping = True
            await supervisor.stop("telemetry", "breakers")
            # 4. close the channels: whatever is still unacked goes back to its queue;
            await consumers.close_channels()
