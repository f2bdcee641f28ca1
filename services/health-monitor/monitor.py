"""The health monitor, wired: its parts, the order in which they start and stop, and the loops that
drive them. It reads telemetry, dead letters, the breaker log and queue depths, and (when it leads)
publishes breaker commands, snapshots, alerts and disabled-endpoint events and repairs the topology.
The decisions are in health.py and alerts.py; what the parts share is in state.py.

The parts, each in a module of its own: which monitor leads and the breaker states as the log says
(leadership.py), the breaker commands and snapshots (commands.py), endpoints disabled (disabling.py),
the queue poll (queues.py) with its repairs (repair.py) and sweeps (sweeps.py), alerts and notifications
(alerting.py), canaries (canary.py), the broker's capacity (brokerwatch.py), the series (metrics.py).

Any number of monitors may run; exactly one leads (leadership.py). Every monitor keeps statistics from
telemetry and answers the status API; a standby mirrors the breaker states from the breaker log, and
the leader alone moves them.

Start-up, in order:
1. the checkpoint on local disk gives back the statistics and the telemetry offset they include;
2. the breaker log's last minutes give back the breaker states;
3. the dead-letter view catches up (from its own offset on disk);
4. the telemetry log is read from the checkpoint's offset (or its last 24 h without one); records read
   during this catch-up move no breaker; then the monitor is live and joins the leader election.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from functools import partial

import structlog
from pydantic import ValidationError

from hookline.health_monitor import checkpoint, metrics
from hookline.health_monitor.alerting import Alerting, endpoints_to_evaluate, load_alerts
from hookline.health_monitor.bindings import Bindings
from hookline.health_monitor.breaker import BreakerPolicy
from hookline.health_monitor.brokerwatch import watch_broker
from hookline.health_monitor.canary import CanarySender
from hookline.health_monitor.commands import BreakerCommands
from hookline.health_monitor.direct import Direct
from hookline.health_monitor.disabling import Disabling
from hookline.health_monitor.health import Health, HealthPolicy
from hookline.health_monitor.leadership import Leadership
from hookline.health_monitor.monitorstate import MonitorState
from hookline.health_monitor.placements import Placements
from hookline.health_monitor.queuepoll import QueuePoll
from hookline.health_monitor.repair import Repair
from hookline.health_monitor.settings import MonitorSettings
from hookline.health_monitor.sinks import AlertSinks
from hookline.health_monitor.sweeps import Sweeps
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker, Publisher, QueueProbe
from hookline.shared.broker.capacity import CapacityReader
from hookline.shared.broker.isolation import Isolation
from hookline.shared.broker.streams import Record, StreamFollower, follow_synced
from hookline.shared.broker.views import follow_view
from hookline.shared.contracts.models import StoredEndpoint, error_summary
from hookline.shared.contracts.telemetry import AttemptRecord, batch
from hookline.shared.runtime.supervision import Loop, Supervisor
from hookline.shared.state.deadletterindex import DeadLetterIndex
from hookline.shared.state.registry import ChangeLog

log = structlog.get_logger(__name__)

#: Registered endpoints up to which the status API and the dashboard list every one.
LISTED_WHOLE = 5_000

SNAPSHOT_INTERVAL_S = 5.0
EVALUATION_INTERVAL_S = 2.0
# dump() runs on the event loop (about 0.1-0.3 s for a day of 1M records): not too often.
CHECKPOINT_INTERVAL_S = 30.0
BREAKER_LOOKBACK = timedelta(minutes=10)
TELEMETRY_WINDOW = timedelta(hours=24)
DEAD_LETTER_RETENTION = timedelta(days=30)


class Monitor:
    def __init__(
        self,
        settings: MonitorSettings,
        broker: Broker,
        publisher: Publisher,
        change_log: ChangeLog,
        dead_letters: DeadLetterIndex,
        sinks: AlertSinks,
        store: checkpoint.CheckpointStore,
        restored: tuple[Health | None, checkpoint.AlertState | None] = (None, None),
    ) -> None:
        """``restored``: the statistics and the alert book a checkpoint gave back (None: none)."""
        health, alert_state = restored
        self._store = store
        self.settings = settings
        self.registry = change_log.registry
        policy = HealthPolicy(
            breaker=BreakerPolicy(
                failure_threshold=settings.breaker_failure_threshold,
                cooldown_s=settings.breaker_cooldown_s,
                max_cooldown_s=settings.breaker_max_cooldown_s,
            ),
            slow_p95_ms=settings.slow_p95_ms,
            very_slow_p95_ms=settings.very_slow_p95_ms,
            very_slow_threshold=settings.breaker_slow_threshold,
            disable_after_s=settings.disable_after_s,
            max_types=settings.max_tracked_types,
        )
        self.health = health if health is not None else Health(policy)
        self.health.policy = policy  # settings win over those a checkpoint was written with
        self.dead_letters = dead_letters
        self.state = MonitorState(settings, broker, publisher, change_log, self.health, dead_letters)
        self.alerting = Alerting(self.state, sinks, store, alert_state)
        isolation = Isolation(
            broker, change_log, max_queues=settings.max_endpoint_queues, timeout_s=settings.connect_timeout_s
        )
        self.bindings = Bindings(
            broker, change_log, grace_s=settings.retired_queue_grace_s, timeout_s=settings.connect_timeout_s
        )
        self.registry.subscribe(self.bindings.on_change)
        self.bindings.seed()
        self.direct = Direct(
            broker, change_log, self.bindings, lambda: self.state.leader, timeout_s=settings.connect_timeout_s
        )
        self.registry.subscribe(self.direct.on_change)
        self.placements = Placements(
            broker, change_log, isolation, self.direct, self.health, slow_p95_ms=settings.slow_p95_ms,
            grace_s=settings.retired_queue_grace_s, timeout_s=settings.connect_timeout_s,
        )  # fmt: skip
        self.leadership = Leadership(self.state, self.direct)
        self.commands = BreakerCommands(self.state, self.placements)
        self.disabling = Disabling(self.state, self.commands)
        probe = QueueProbe(broker)  # one for the poll, its sweeps and repairs: the poll closes it
        sweeps, repair = Sweeps(self.state, probe), Repair(self.state, probe, self.direct)
        self.queues = QueuePoll(self.state, probe, self.placements, self.bindings, sweeps, repair)
        self.canary_sender = CanarySender(self.state)

    @property
    def blocked(self) -> bool:
        """The broker refuses this monitor's publishes (a memory or disk alarm)."""
        return self.state.broker.blocked

    def on_telemetry(self, message: Record) -> None:
        try:
            records = batch.validate_json(message.body)
        except ValidationError as exc:
            log.error("telemetry_unreadable", error=error_summary(exc))
            return
        now_s = time.time()
        moving = self.state.live and self.state.leader
        for record in records:
            self.commands.put(self.health.observe(record, now_s=now_s, live=moving))
            if isinstance(record, AttemptRecord):
                self.state.canaries.on_attempt(record)

    async def tick(self, loop: Loop) -> None:
        next_snapshot_s = next_evaluation_s = 0.0
        loop.mark_up()
        while True:
            loop.beat()
            now_s = time.time()
            if self.state.leader:
                self.commands.put(self.health.tick(now_s=now_s))
                await self.disabling.disable_due(now_s=now_s)
                if now_s >= next_snapshot_s:
                    await self.commands.publish_snapshot(now_s=now_s)
                    next_snapshot_s = now_s + SNAPSHOT_INTERVAL_S
            if now_s >= next_evaluation_s:
                # Alerts and metrics merge every endpoint's windows: every few ticks is enough.
                await self.alerting.alert(now_s=now_s)
                await metrics.export(self.state, self.alerting.alerts, now_s)
                next_evaluation_s = now_s + max(self.settings.tick_s, EVALUATION_INTERVAL_S)
            await asyncio.sleep(self.settings.tick_s)

    async def checkpoint_loop(self, telemetry: StreamFollower, loop: Loop) -> None:
        """The statistics and the telemetry offset they include, to local disk every few seconds."""
        loop.mark_up()
        while True:
            await asyncio.sleep(CHECKPOINT_INTERVAL_S)
            await self.save_checkpoint(telemetry)
            await self.dead_letters.expire(datetime.now(UTC) - DEAD_LETTER_RETENTION)
            loop.beat()

    async def save_checkpoint(self, telemetry: StreamFollower) -> None:
        """Once a telemetry record has been read: the statistics, with the offset of the last record
        they include (a restart reads on from the next); and the alert book, if it changed."""
        offset = telemetry.next_offset
        if isinstance(offset, int) and offset > 0:
            self.health.prune(now_s=time.time())
            # dump() runs on the loop: it must see a consistent Health, which only the loop changes.
            data = checkpoint.dump(self.health)
            await self._store.save(data, offset=offset - 1, identity=_telemetry_identity(self.state.broker))
        await self.alerting.save()

    def endpoints_listed(self, tenant: str | None) -> list[StoredEndpoint]:
        """What the status API and the dashboard list: a tenant's endpoints; across tenants, every one
        while there are at most ``LISTED_WHOLE``, past that those with telemetry or a queue of their own
        (among a million, an idle endpoint says nothing)."""
        if tenant is not None:
            return self.registry.rows.of_tenant(tenant)
        if len(self.registry) <= LISTED_WHOLE:
            return self.registry.rows.all()
        return list(endpoints_to_evaluate(self.registry, self.health, {}, {}).values())


def _telemetry_identity(broker: Broker) -> str:
    """The stream a checkpoint's offset belongs to: another vhost's telemetry log has other offsets."""
    return f"{broker.vhost}/{topology.TELEMETRY_LOG}"


async def _load_checkpoint(
    store: checkpoint.CheckpointStore, broker: Broker
) -> tuple[Health | None, int | None]:
    found = await store.read(_telemetry_identity(broker))
    if found is None:
        return None, None
    data, offset = found
    try:
        health = checkpoint.load(data, policy=HealthPolicy())
    except checkpoint.CheckpointError as exc:
        log.warning("checkpoint_unusable", error=str(exc)[:200])
        return None, None
    return health, offset


async def _catch_up(
    settings: MonitorSettings,
    broker: Broker,
    publisher: Publisher,
    supervisor: Supervisor,
    monitor: Monitor,
    dead_letters: DeadLetterIndex,
    telemetry_offset: int | None,
) -> StreamFollower:
    """Start-up steps 2 to 4: the breaker log, the dead-letter view, the telemetry log. Returns the
    telemetry's follower, whose offset the checkpoints record."""
    wait_s = settings.connect_timeout_s
    breaker_log = StreamFollower(
        broker, topology.BREAKER_LOG, monitor.leadership.on_breaker_log, publisher=publisher,
        start=datetime.now(UTC) - BREAKER_LOOKBACK, prefetch=100,
    )  # fmt: skip
    await follow_synced(supervisor, "breaker-log", breaker_log, timeout_s=wait_s)
    monitor.leadership.restore_breakers()
    dead_letter_log = StreamFollower(
        broker, topology.DEAD_LETTER_STREAM, dead_letters.apply, publisher=publisher,
        start=dead_letters.next_offset,
    )  # fmt: skip
    view = partial(follow_view, dead_letter_log, dead_letters)
    await follow_synced(supervisor, "dead-letters", dead_letter_log, view, timeout_s=wait_s)
    telemetry = StreamFollower(
        broker, topology.TELEMETRY_LOG, monitor.on_telemetry, publisher=publisher,
        start=telemetry_offset + 1 if telemetry_offset is not None else datetime.now(UTC) - TELEMETRY_WINDOW,
    )  # fmt: skip
    # Without a checkpoint, a day of telemetry is read: that takes minutes, not a connect timeout.
    sync_s = max(wait_s, 300)
    await follow_synced(supervisor, "telemetry", telemetry, timeout_s=wait_s, sync_timeout_s=sync_s)
    return telemetry


def _spawn_loops(
    settings: MonitorSettings,
    supervisor: Supervisor,
    monitor: Monitor,
    telemetry: StreamFollower,
    capacity: CapacityReader,
) -> None:
    """The loops of a live monitor (:func:`monitoring` stops them, in its own order)."""
    supervisor.spawn("leadership", monitor.leadership.lead_when_possible)
    supervisor.spawn("breaker-commands", monitor.commands.publish_commands)
    supervisor.spawn("tick", monitor.tick, stall_s=60)
    supervisor.spawn("queues", monitor.queues.poll_queues, stall_s=120)
    supervisor.spawn("direct-routes", monitor.direct.run, stall_s=120)
    supervisor.spawn("checkpoint", partial(monitor.checkpoint_loop, telemetry), stall_s=120)
    supervisor.spawn("broker", partial(watch_broker, monitor.state, capacity), stall_s=120)
    if settings.canary_interval_s > 0:
        supervisor.spawn(
            "canaries", monitor.canary_sender.send_canaries, stall_s=max(60, 3 * settings.canary_interval_s)
        )


@asynccontextmanager
async def monitoring(
    settings: MonitorSettings,
    broker: Broker,
    publisher: Publisher,
    supervisor: Supervisor,
    change_log: ChangeLog,
    capacity: CapacityReader,
    sinks: AlertSinks,
) -> AsyncIterator[Monitor]:
    state_path = settings.state_file("health-monitor", settings.monitor_port)
    async with (
        checkpoint.CheckpointStore(state_path.with_suffix(".checkpoint.sqlite")) as store,
        DeadLetterIndex(state_path, identity=f"{broker.vhost}/{topology.DEAD_LETTER_STREAM}") as dead_letters,
    ):
        started = time.monotonic()
        health, offset = await _load_checkpoint(store, broker)
        restored = (health, await load_alerts(store, broker))
        monitor = Monitor(settings, broker, publisher, change_log, dead_letters, sinks, store, restored)
        telemetry = await _catch_up(settings, broker, publisher, supervisor, monitor, dead_letters, offset)
        monitor.state.live = True
        log.info(
            "telemetry_caught_up",
            seconds=round(time.monotonic() - started, 2),
            from_checkpoint=offset is not None,
            endpoints=len(monitor.health.endpoints),
        )
        _spawn_loops(settings, supervisor, monitor, telemetry, capacity)
        try:
            yield monitor
        finally:
            # Shutdown, in order:
            # 1. the loops (leadership first: the lock goes with its channel), the checkpoint's among them,
            #    so that nothing saves beside the last save below;
            await supervisor.stop(
                "leadership",
                "tick",
                "breaker-commands",
                "queues",
                "direct-routes",
                "checkpoint",
                "broker",
                "canaries",
            )
            # 2. a last checkpoint, so that the next start reads only what came after it;
            await monitor.save_checkpoint(telemetry)
            # 3. the followers; then the views close as the `async with` above ends.
            await supervisor.stop("telemetry", "dead-letters", "breaker-log")
