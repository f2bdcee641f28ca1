"""What the ingest opens and runs behind its routes, in order: the broker session, the HTTP client of
its own attempts, the local views kept in its state file; then the endpoint log and the dead letters
read up to now (an answer never misses a write acknowledged before), the delivery log's and audit's
views and the loops; and, on the way out, the same in reverse."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial

import structlog
from pydantic import ValidationError

from hookline.ingest import audit, queues, quotas
from hookline.ingest.attempts import Attempts
from hookline.ingest.auth import parse_tenant_tokens
from hookline.ingest.bound import BoundPatterns
from hookline.ingest.deliverylog import DeliveryLog
from hookline.ingest.duplicates import Duplicates
from hookline.ingest.replicas import Replicas
from hookline.ingest.settings import IngestSettings
from hookline.ingest.state import IngestState
from hookline.shared import __version__
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.broker.capacity import CapacityReader
from hookline.shared.broker.heldpublishes import HeldPublishes
from hookline.shared.broker.isolation import Isolation
from hookline.shared.broker.streams import Record, StreamFollower, follow_synced
from hookline.shared.broker.views import RowView, follow_view
from hookline.shared.contracts.control import BREAKER_LOOKBACK, BreakerView, control_record
from hookline.shared.contracts.models import error_summary
from hookline.shared.outbound.credentials import Credentials
from hookline.shared.outbound.delivery import DeliveryClient
from hookline.shared.outbound.sealing import Sealer
from hookline.shared.outbound.transforms import Transformer
from hookline.shared.runtime.supervision import Loop, Supervisor
from hookline.shared.runtime.tracing import Tracing
from hookline.shared.state import registry
from hookline.shared.state.deadletterindex import DeadLetterIndex

log = structlog.get_logger(__name__)

EXPIRY_INTERVAL_S = 600.0
#: Attempt and audit records held while the broker refuses publishes. The ingest's own attempts are
#: made by hand (resends, verifications), so this is far more than an alarm's worth; an attempt record
#: with its receiver's answer is about 6 KiB sealed, so at most about 60 MB.
HELD_RECORDS_MAX = 10_000


@dataclass(frozen=True)
class _Stores:
    """What the ingest opens before it follows anything: the broker session, the HTTP client of its
    own attempts, the broker's capacity reader and the local views kept in the state file."""

    broker: Broker
    dead_letters: DeadLetterIndex
    client: DeliveryClient
    capacity: CapacityReader
    delivery_log: DeliveryLog
    audit_view: RowView
    replicas: Replicas
    registry: registry.EndpointRegistry
    transformer: Transformer  # test events' and resends' transforms, and POST /v1/transforms/test


@asynccontextmanager
async def _stores(settings: IngestSettings) -> AsyncIterator[_Stores]:
    state_path = settings.state_file("ingest", settings.ingest_port)
    replicas = Replicas()
    async with (
        Broker(
            settings.amqp_url, name="hookline-ingest", connect_timeout_s=settings.connect_timeout_s
        ) as broker,
        DeadLetterIndex(state_path, identity=f"{broker.vhost}/{topology.DEAD_LETTER_STREAM}") as dead_letters,
        DeliveryClient.for_endpoints(
            settings, max_connections=32, user_agent=f"hookline/{__version__}"
        ) as client,
        CapacityReader.of(settings) as capacity,
        DeliveryLog(
            state_path,
            vhost=broker.vhost,
            retention_s=settings.delivery_log_retention_s,
            max_bytes=settings.delivery_log_max_bytes,
            on_heartbeat=replicas.observe,  # the delivery log reads the telemetry anyway
        ) as delivery_log,
        audit.view(state_path, vhost=broker.vhost) as audit_view,
        registry.kept_at(state_path.with_suffix(".registry.sqlite"), vhost=broker.vhost) as endpoint_registry,
        Transformer(workers=1, max_bytes=settings.max_payload_bytes) as transformer,
    ):
        yield _Stores(
            broker, dead_letters, client, capacity, delivery_log, audit_view, replicas, endpoint_registry,
            transformer,
        )  # fmt: skip


@asynccontextmanager
async def running(settings: IngestSettings) -> AsyncIterator[IngestState]:
    """The ingest's state, with everything behind it open and running. Shutdown (once the HTTP server
    has finished its requests) runs in reverse: the loops stop, then the channels, then the last spans
    are exported; then the broker session and the local views close."""
    async with _stores(settings) as stores, _running(settings, stores) as state:
        yield state


@asynccontextmanager
async def _running(settings: IngestSettings, stores: _Stores) -> AsyncIterator[IngestState]:
    """The followed streams and the loops behind the routes. The endpoint log and the dead letters are
    read up to now before the first request: an answer never misses a write acknowledged before."""
    supervisor = Supervisor()
    tracing = Tracing("ingest", settings.otlp_endpoint)
    broker = stores.broker
    await topology.declare(broker, settings.retention)
    publisher = Publisher(broker)
    held = HeldPublishes(publisher, max_held=HELD_RECORDS_MAX)
    try:
        endpoint_registry = stores.registry
        bound = BoundPatterns(endpoint_registry)
        endpoint_registry.subscribe(bound.on_change)
        change_log = await registry.follow(
            broker, publisher, supervisor, endpoint_registry, sync_timeout_s=settings.connect_timeout_s
        )
        dead_letter_log = StreamFollower(
            broker,
            topology.DEAD_LETTER_STREAM,
            stores.dead_letters.apply,
            publisher=publisher,
            start=stores.dead_letters.next_offset,
        )
        view = partial(follow_view, dead_letter_log, stores.dead_letters)
        await follow_synced(
            supervisor, "dead-letters", dead_letter_log, view, timeout_s=settings.connect_timeout_s
        )
        breakers = BreakerView()
        _follow_delivery_log(broker, publisher, supervisor, stores.delivery_log, breakers, stores.audit_view)
        sealer = Sealer(settings.secret_key.get_secret_value() if settings.secret_key else None)
        state = IngestState(
            settings=settings,
            broker=broker,
            supervisor=supervisor,
            change_log=change_log,
            registry=endpoint_registry,
            publisher=publisher,
            dead_letters_log=dead_letter_log,
            dead_letters_index=stores.dead_letters,
            attempts=Attempts(sealer, Credentials(sealer, stores.client), held, stores.transformer),
            capacity=stores.capacity,
            delivery_log=stores.delivery_log,
            duplicates=Duplicates(stores.delivery_log, window_s=settings.dedupe_window_s),
            breakers=breakers,
            sealer=sealer,
            tracing=tracing,
            tenant_tokens=parse_tenant_tokens(
                settings.tenant_tokens.get_secret_value() if settings.tenant_tokens else None
            ),
            quotas=quotas.Quotas(change_log.tenants, endpoint_registry, stores.delivery_log),
            audit=stores.audit_view,
            trail=audit.AuditTrail(held, broker.user),
            replicas=stores.replicas,
            bound=bound,
            isolation=Isolation(
                broker,
                change_log,
                max_queues=settings.max_endpoint_queues,
                timeout_s=settings.registry_wait_s,
            ),
        )
        supervisor.spawn("upgrade", partial(_upgrade_endpoints, state), required=False)
        supervisor.spawn("held-records", partial(held.run, broker), required=False)
        yield state
    finally:
        await supervisor.stop()
        await held.close()
        await publisher.close()
        await asyncio.to_thread(tracing.shutdown)  # the last spans (the exporter blocks)


def _follow_delivery_log(
    broker: Broker,
    publisher: Publisher,
    supervisor: Supervisor,
    delivery_log: DeliveryLog,
    breakers: BreakerView,
    audit_view: RowView,
) -> None:
    """The delivery log's views, the audit trail's and the breaker states the delivery log explains
    waits with. Not required: a view catching up (or down a while) leaves the ingest taking events; its
    answers are then behind."""
    for name, view, stream in (
        ("delivery-log-events", delivery_log.events, topology.EVENT_LOG),
        ("delivery-log-attempts", delivery_log.attempts, topology.TELEMETRY_LOG),
        ("audit", audit_view, topology.AUDIT_LOG),
    ):
        follower = StreamFollower(broker, stream, view.apply, publisher=publisher, start=view.next_offset)
        supervisor.spawn(name, partial(follow_view, follower, view), required=False)
    breaker_log = StreamFollower(
        broker, topology.BREAKER_LOG, partial(_apply_breakers, breakers), publisher=publisher,
        start=datetime.now(UTC) - BREAKER_LOOKBACK, prefetch=100,
    )  # fmt: skip
    supervisor.spawn("breakers", breaker_log.run, required=False)
    supervisor.spawn("delivery-log-expiry", partial(_expire, delivery_log, audit_view), required=False)


def _apply_breakers(breakers: BreakerView, message: Record) -> None:
    try:
        breakers.apply(control_record.validate_json(message.body))
    except ValidationError as exc:
        log.error("control_record_unreadable", error=error_summary(exc))


async def _expire(delivery_log: DeliveryLog, audit_view: RowView, loop: Loop) -> None:
    loop.mark_up()
    while True:
        removed = await delivery_log.expire(now_s=time.time())
        if removed:
            log.info("delivery_log_expired", rows=removed)
        removed = await audit.expire(audit_view, now_s=time.time())
        if removed:
            log.info("audit_expired", rows=removed)
        loop.beat()
        await asyncio.sleep(EXPIRY_INTERVAL_S)


async def _upgrade_endpoints(state: IngestState, loop: Loop) -> None:
    """Endpoints not settled on their lane are settled, once (``queues.settle``; any ingest replica
    may do it: binding is idempotent, the records are conditional, a fence sent twice is dropped)."""
    loop.mark_up()
    for endpoint in state.registry.to_settle():
        await queues.settle(state, endpoint.id)
        await asyncio.sleep(0)
    await asyncio.Event().wait()  # done; stays "up" so that the supervisor does not run it again
