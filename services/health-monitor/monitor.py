"""The health monitor's I/O: it reads telemetry, dead letters and queue depths, and publishes breaker
commands, snapshots, alerts and disabled-endpoint events. The decisions are in health.py and alerts.py.

Start-up, in order:
1. the breaker log's last minutes give back the breaker states (the monitor owns them);
2. the dead-letter stream is indexed (for the analysis and the "growing" alert);
3. the telemetry log's last 24 h rebuild the statistics; records read during this replay move no
   breaker; then the monitor is live.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

import aio_pika
import orjson
import prometheus_client
import structlog
from aio_pika.abc import AbstractExchange, AbstractIncomingMessage, AbstractRobustConnection
from pydantic import ValidationError

from hookline.health_monitor.alerts import Alert, AlertBook, AlertPolicy, evaluate
from hookline.health_monitor.breaker import BreakerPolicy
from hookline.health_monitor.health import Health, HealthPolicy
from hookline.shared import topology
from hookline.shared.amqp import BROKER_ERRORS
from hookline.shared.control import BreakerCommand, BreakerState, BreakerView, ControlRecord, control_record
from hookline.shared.deadletters import DeadLetterIndex, counts_since
from hookline.shared.headers import Header
from hookline.shared.ids import new_id
from hookline.shared.models import EndpointStatus, EndpointUpserted, Event, error_summary
from hookline.shared.registry import ChangeLog
from hookline.shared.settings import MonitorSettings
from hookline.shared.streams import StreamFollower, read_until_now
from hookline.shared.telemetry import batch

log = structlog.get_logger(__name__)

SNAPSHOT_INTERVAL_S = 5.0
EVALUATION_INTERVAL_S = 2.0
BREAKER_LOOKBACK = timedelta(minutes=10)
TELEMETRY_WINDOW = timedelta(hours=24)
DISABLED_EVENT_TYPE = "hookline.endpoint.disabled"

BREAKER_STATE = prometheus_client.Gauge(
    "hookline_breaker_state", "Breaker per endpoint: 0 closed, 1 half open, 2 open.", ["endpoint_id"]
)
ENDPOINT_P95_MS = prometheus_client.Gauge(
    "hookline_endpoint_latency_p95_ms", "p95 attempt latency per endpoint.", ["endpoint_id", "window"]
)
QUEUE_DEPTH = prometheus_client.Gauge(
    "hookline_endpoint_queue_depth", "Ready messages per endpoint queue.", ["endpoint_id"]
)
AWAITING_RETRY = prometheus_client.Gauge("hookline_awaiting_retry", "Messages waiting in the delay queues.")
DEAD_LETTERS = prometheus_client.Gauge("hookline_dead_letters", "Dead letters not yet redriven.")
ALERTS_FIRING = prometheus_client.Gauge("hookline_alerts_firing", "Alerts firing, by name.", ["alert"])
_STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class Monitor:
    def __init__(
        self, settings: MonitorSettings, connection: AbstractRobustConnection, change_log: ChangeLog
    ) -> None:
        self.settings = settings
        self.registry = change_log.registry
        self._connection = connection
        self._change_log = change_log
        self.health = Health(
            HealthPolicy(
                breaker=BreakerPolicy(
                    failure_threshold=settings.breaker_failure_threshold,
                    cooldown_s=settings.breaker_cooldown_s,
                    max_cooldown_s=settings.breaker_max_cooldown_s,
                ),
                slow_p95_ms=settings.slow_p95_ms,
                very_slow_p95_ms=settings.very_slow_p95_ms,
                very_slow_threshold=settings.breaker_slow_threshold,
                disable_after_s=settings.disable_after_s,
            )
        )
        self.alert_policy = AlertPolicy(
            slow_p95_ms=settings.slow_p95_ms, oldest_pending_s=settings.oldest_pending_alert_s
        )
        self.alerts = AlertBook()
        self.dead_letters = DeadLetterIndex()
        self.awaiting_retry = 0
        self.live = False
        self._outbox: asyncio.Queue[BreakerCommand] = asyncio.Queue()

    # --- telemetry ---------------------------------------------------------------------------

    def on_telemetry(self, message: AbstractIncomingMessage) -> None:
        try:
            records = batch.validate_json(message.body)
        except ValidationError as exc:
            log.error("telemetry_unreadable", error=error_summary(exc))
            return
        now_s = time.time()
        for record in records:
            for command in self.health.observe(record, now_s=now_s, live=self.live):
                self._outbox.put_nowait(command)

    # --- the loops -----------------------------------------------------------------------------

    async def publish_commands(self, control: AbstractExchange) -> None:
        while True:
            command = await self._outbox.get()
            try:
                await self._publish_control(control, command)
            except BROKER_ERRORS as exc:
                # Not lost: the next snapshot (every few seconds) carries the state anyway.
                log.warning(
                    "breaker_command_unpublished", endpoint_id=command.endpoint_id, error=type(exc).__name__
                )
                continue
            log.warning(
                "breaker_changed",
                endpoint_id=command.endpoint_id,
                state=command.state.value,
                probe_by=command.probe_by,
                cooldown_s=command.cooldown_s,
            )

    async def tick(
        self, control: AbstractExchange, alerts: AbstractExchange, events: AbstractExchange
    ) -> None:
        next_snapshot_s = next_evaluation_s = 0.0
        while True:
            now_s = time.time()
            for command in self.health.tick(now_s=now_s):
                self._outbox.put_nowait(command)
            for endpoint_id in self.health.to_disable(now_s=now_s):
                await self._disable(endpoint_id, events, now_s=now_s)
            if now_s >= next_snapshot_s:
                await self._publish_control(control, self.health.snapshot(now_s=now_s))
                next_snapshot_s = now_s + SNAPSHOT_INTERVAL_S
            if now_s >= next_evaluation_s:
                # Alerts and metrics merge every endpoint's windows: every few ticks is enough.
                await self._alert(alerts, now_s=now_s)
                self._export_metrics(now_s)
                next_evaluation_s = now_s + max(self.settings.tick_s, EVALUATION_INTERVAL_S)
            await asyncio.sleep(self.settings.tick_s)

    async def poll_queues(self) -> None:
        """Queue depths by passive declares: ready messages per endpoint queue and in the delay levels."""
        while True:
            try:
                channel = await self._connection.channel()
            except BROKER_ERRORS:
                await asyncio.sleep(self.settings.queue_poll_s)
                continue
            try:
                self.awaiting_retry = sum(
                    [
                        await _depth(channel, topology.delay_level(level))
                        for level in range(topology.DELAY_BITS)
                    ]
                )
                for endpoint in self.registry.all():
                    self.health.endpoint(endpoint.id).queue_depth = await _depth(
                        channel, topology.endpoint_queue(endpoint.id)
                    )
            except BROKER_ERRORS as exc:
                # An endpoint deleted meanwhile (its queue is gone), or the broker is away: next round.
                log.debug("queue_poll_incomplete", error=type(exc).__name__)
            finally:
                if not channel.is_closed:
                    with contextlib.suppress(*BROKER_ERRORS):
                        await channel.close()
            await asyncio.sleep(self.settings.queue_poll_s)

    # --- actions -------------------------------------------------------------------------------

    async def _publish_control(self, control: AbstractExchange, record: ControlRecord) -> None:
        await control.publish(
            aio_pika.Message(
                control_record.dump_json(record),
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                message_id=new_id("ctl"),
            ),
            routing_key="",
        )

    async def _disable(self, endpoint_id: str, events: AbstractExchange, *, now_s: float) -> None:
        """Open longer than the limit: disable the endpoint and tell its tenant with an event."""
        endpoint = self.registry.get(endpoint_id)
        for command in self.health.reset(endpoint_id, now_s=now_s):
            self._outbox.put_nowait(command)
        if endpoint is None or endpoint.status is not EndpointStatus.ACTIVE:
            return
        now = datetime.now(UTC)
        disabled = endpoint.model_copy(update={"status": EndpointStatus.DISABLED, "updated_at": now})
        await self._change_log.append(
            EndpointUpserted(change_id=f"chg_{uuid.uuid4().hex}", at=now, endpoint=disabled),
            timeout_s=self.settings.connect_timeout_s,
        )
        reason = f"circuit breaker open for more than {self.settings.disable_after_s:.0f} s"
        event = Event(
            id=new_id("evt"),
            type=DISABLED_EVENT_TYPE,
            tenant=endpoint.tenant,
            occurred_at=now,
            data={
                "endpoint_id": endpoint.id,
                "url": endpoint.url,
                "reason": reason,
                "disabled_at": now.isoformat(),
            },
        )
        await events.publish(
            aio_pika.Message(
                event.model_dump_json(exclude_none=True).encode(),
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                message_id=event.id,
                timestamp=now,
                headers={Header.ACCEPTED_AT_MS: int(now.timestamp() * 1000)},
            ),
            routing_key=topology.event_routing_key(endpoint.tenant, DISABLED_EVENT_TYPE),
        )
        log.warning(
            "endpoint_disabled", endpoint_id=endpoint.id, tenant=endpoint.tenant, reason=reason, alert=True
        )

    async def _alert(self, alerts: AbstractExchange, *, now_s: float) -> None:
        recent = counts_since(self.dead_letters, datetime.fromtimestamp(now_s, UTC) - timedelta(minutes=5))
        current = evaluate(
            self.health,
            {endpoint.id: endpoint for endpoint in self.registry.all()},
            recent_dead_letters=lambda endpoint_id: recent.get(endpoint_id, 0),
            now_s=now_s,
            policy=self.alert_policy,
        )
        fired, resolved = self.alerts.update(current)
        for state, changed in (("firing", fired), ("resolved", resolved)):
            for alert in changed:
                await _publish_alert(alerts, alert, state, now_s)

    def _export_metrics(self, now_s: float) -> None:
        for gauge in (BREAKER_STATE, ENDPOINT_P95_MS, QUEUE_DEPTH, ALERTS_FIRING):
            gauge.clear()
        for endpoint_id, health in self.health.endpoints.items():
            BREAKER_STATE.labels(endpoint_id).set(_STATE_VALUE[health.breaker.state])
            for window, stats in (("24h", health.day), ("5m", health.recent)):
                p95 = stats.total(now_s=now_s).percentile_ms(0.95)
                if p95 is not None:
                    ENDPOINT_P95_MS.labels(endpoint_id, window).set(p95)
            if health.queue_depth is not None:
                QUEUE_DEPTH.labels(endpoint_id).set(health.queue_depth)
        for name, _ in self.alerts.firing:
            ALERTS_FIRING.labels(name).inc()
        AWAITING_RETRY.set(self.awaiting_retry)
        DEAD_LETTERS.set(len(self.dead_letters))


async def _depth(channel: aio_pika.abc.AbstractChannel, queue: str) -> int:
    declared = await channel.declare_queue(queue, passive=True)
    return declared.declaration_result.message_count or 0


async def _publish_alert(alerts: AbstractExchange, alert: Alert, state: str, now_s: float) -> None:
    body = {
        "alert": alert.name,
        "state": state,
        "endpoint_id": alert.endpoint_id,
        "tenant": alert.tenant,
        "detail": alert.detail,
        "at": datetime.fromtimestamp(now_s, UTC).isoformat(),
    }
    log.warning("alert", **body)
    with contextlib.suppress(*BROKER_ERRORS):
        await alerts.publish(
            aio_pika.Message(orjson.dumps(body), content_type="application/json", message_id=new_id("alert")),
            routing_key=f"{alert.name}.{state}",
        )


async def _restore_breakers(
    connection: AbstractRobustConnection, health: Health, *, timeout_s: float
) -> None:
    view = BreakerView()

    def apply(message: AbstractIncomingMessage) -> None:
        with contextlib.suppress(ValidationError):
            view.apply(control_record.validate_json(message.body))

    await read_until_now(
        connection,
        topology.BREAKER_LOG,
        apply,
        start=datetime.now(UTC) - BREAKER_LOOKBACK,
        timeout_s=timeout_s,
    )
    for command in view.commands():
        health.restore(command)
    if view.commands():
        log.info("breakers_restored", open=len(view.commands()))


@asynccontextmanager
async def monitoring(
    settings: MonitorSettings, connection: AbstractRobustConnection, change_log: ChangeLog
) -> AsyncIterator[Monitor]:
    monitor = Monitor(settings, connection, change_log)
    await _restore_breakers(connection, monitor.health, timeout_s=settings.connect_timeout_s)

    dead_letters = StreamFollower(connection, topology.DEAD_LETTER_STREAM, monitor.dead_letters.apply)
    await dead_letters.start()
    await dead_letters.sync(timeout_s=settings.connect_timeout_s)

    started = time.monotonic()
    telemetry = StreamFollower(
        connection, topology.TELEMETRY_LOG, monitor.on_telemetry, start=datetime.now(UTC) - TELEMETRY_WINDOW
    )
    await telemetry.start()
    await telemetry.sync(timeout_s=max(settings.connect_timeout_s, 300))
    monitor.live = True
    log.info(
        "telemetry_replayed",
        seconds=round(time.monotonic() - started, 2),
        endpoints=len(monitor.health.endpoints),
    )

    publisher = await connection.channel(publisher_confirms=True)
    control = await publisher.get_exchange(topology.CONTROL_EXCHANGE, ensure=False)
    alerts = await publisher.get_exchange(topology.ALERTS_EXCHANGE, ensure=False)
    events = await publisher.get_exchange(topology.EVENTS_EXCHANGE, ensure=False)
    tasks = [
        asyncio.create_task(monitor.publish_commands(control), name="breaker-commands"),
        asyncio.create_task(monitor.tick(control, alerts, events), name="tick"),
        asyncio.create_task(monitor.poll_queues(), name="queue-depths"),
    ]
    try:
        yield monitor
    finally:
        # Stop the loops, then the followers, then the channel; nothing here holds a delivery.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await telemetry.stop()
        await dead_letters.stop()
        if not publisher.is_closed:
            await publisher.close()
