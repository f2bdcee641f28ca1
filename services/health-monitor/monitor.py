"""The health monitor's I/O: it reads telemetry, dead letters, the breaker log and queue depths, and (when
it leads) publishes breaker commands, snapshots, alerts and disabled-endpoint events and repairs the
topology. The decisions are in health.py and alerts.py.

Any number of monitors may run; exactly one leads, the one holding the exclusive queue
``hookline.monitor.leader`` (the broker deletes it with its owner's connection, so a standby takes over
within a second of the leader's death, or within a heartbeat timeout of a network cut). Every monitor
keeps statistics from telemetry and answers the status API; a standby mirrors the breaker states from
the breaker log, and the leader alone moves them.

Start-up, in order:
1. the checkpoint on local disk gives back the statistics and the telemetry offset they include;
2. the breaker log's last minutes give back the breaker states;
3. the dead-letter view catches up (from its own offset on disk);
4. the telemetry log is read from the checkpoint's offset (or its last 24 h without one); records read
   during this catch-up move no breaker; then the monitor is live and joins the leader election.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from functools import partial

import aio_pika
import aiormq
import orjson
import prometheus_client
import structlog
from pydantic import ValidationError

from hookline.health_monitor import checkpoint, series
from hookline.health_monitor.alerts import Alert, AlertBook, AlertKey, AlertPolicy, broker_alerts, evaluate
from hookline.health_monitor.bindings import Bindings
from hookline.health_monitor.breaker import Breaker, BreakerPolicy
from hookline.health_monitor.canary import CANARY_TYPE, CanaryBook
from hookline.health_monitor.direct import Direct
from hookline.health_monitor.health import EndpointHealth, Health, HealthPolicy
from hookline.health_monitor.placements import Placements
from hookline.health_monitor.settings import MonitorSettings
from hookline.health_monitor.sinks import AlertSinks
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import (
    BROKER_ERRORS,
    CALL_TIMEOUT_S,
    Broker,
    Publisher,
    QueueProbe,
    until_closed,
)
from hookline.shared.broker.capacity import BrokerCapacity, CapacityReader
from hookline.shared.broker.heldpublishes import HeldPublishes
from hookline.shared.broker.isolation import Isolation
from hookline.shared.broker.streams import Record, StreamFollower, follow_synced, offset_of
from hookline.shared.broker.views import follow_view
from hookline.shared.contracts import addressing
from hookline.shared.contracts.control import (
    BreakerCommand,
    BreakerState,
    BreakerView,
    ControlRecord,
    control_record,
)
from hookline.shared.contracts.envelope import event_message
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import (
    EndpointDeleted,
    EndpointStatus,
    Event,
    StoredEndpoint,
    error_summary,
)
from hookline.shared.contracts.telemetry import AttemptRecord, batch
from hookline.shared.runtime.supervision import Loop, Supervisor
from hookline.shared.state import notifications
from hookline.shared.state.deadletterindex import DeadLetterIndex
from hookline.shared.state.registry import ChangeLog, StaleWriteError

log = structlog.get_logger(__name__)

#: Registered endpoints up to which the status API and the dashboard list every one.
LISTED_WHOLE = 5_000

#: How long a repair waits for core names it may not declare itself (the ingest declares them).
REPAIR_WAIT_S = 5.0

SNAPSHOT_INTERVAL_S = 5.0
UNSENT_MAX = 1_000
EVALUATION_INTERVAL_S = 2.0
# dump() runs on the event loop (about 0.1-0.3 s for a day of 1M records): not too often.
CHECKPOINT_INTERVAL_S = 30.0
LEADER_RETRY_S = 1.0
BREAKER_LOOKBACK = timedelta(minutes=10)
TELEMETRY_WINDOW = timedelta(hours=24)
DEAD_LETTER_RETENTION = timedelta(days=30)
#: Deleted endpoints whose queues are still watched until drained and removed.
DELETED_WATCH_WINDOW = timedelta(days=1)
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
LANE_DEPTH = prometheus_client.Gauge(
    "hookline_lane_depth", "Ready messages per lane (events not yet fanned out to their endpoints).", ["lane"]
)
DEAD_LETTERS = prometheus_client.Gauge("hookline_dead_letters_pending", "Dead letters not yet redriven.")
ALERTS_FIRING = prometheus_client.Gauge("hookline_alerts_firing", "Alerts firing, by name.", ["alert"])
LEADER = prometheus_client.Gauge("hookline_monitor_leader", "1 while this health monitor leads.")
QUEUES_MISSING = prometheus_client.Gauge(
    "hookline_queues_missing", "Queues and streams found missing at the last poll (declared again)."
)
BROKER_MEMORY_ALARM = prometheus_client.Gauge(
    "hookline_broker_memory_alarm", "1 while the broker's memory alarm is raised (NaN: unreadable)."
)
BROKER_DISK_ALARM = prometheus_client.Gauge(
    "hookline_broker_disk_alarm", "1 while the broker's disk alarm is raised (NaN: unreadable)."
)
BROKER_DISK_FREE = prometheus_client.Gauge("hookline_broker_disk_free_bytes", "Free disk on the broker.")
BROKER_DISK_FREE_LIMIT = prometheus_client.Gauge(
    "hookline_broker_disk_free_limit_bytes", "Free disk under which the broker blocks every publisher."
)
BROKER_FD_USED = prometheus_client.Gauge(
    "hookline_broker_file_descriptors_used", "File handles the broker uses."
)
BROKER_FD_LIMIT = prometheus_client.Gauge(
    "hookline_broker_file_descriptors_limit", "File handles the broker may use."
)
BROKER_QUEUES = prometheus_client.Gauge("hookline_broker_queues", "Queues on the broker, every vhost.")
CANARY_LATENCY = prometheus_client.Gauge(
    "hookline_canary_latency_seconds",
    "The last canary's publish-to-delivery time, per endpoint.",
    ["endpoint_id"],
)
CANARIES_SENT = prometheus_client.Counter("hookline_canaries_sent", "Canary events published.")
BROKER_GAUGES = [BROKER_MEMORY_ALARM, BROKER_DISK_ALARM, BROKER_DISK_FREE, BROKER_DISK_FREE_LIMIT]
BROKER_GAUGES += [BROKER_FD_USED, BROKER_FD_LIMIT, BROKER_QUEUES]
_STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


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
        self._sinks = sinks
        self._store = store
        self.settings = settings
        self.registry = change_log.registry
        self._broker = broker
        self._publisher = publisher
        self._change_log = change_log
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
        self.alert_policy = AlertPolicy(
            slow_p95_ms=settings.slow_p95_ms,
            oldest_pending_s=settings.oldest_pending_alert_s,
            broker_disk_headroom_bytes=settings.broker_disk_headroom_bytes,
            broker_fd_ratio=settings.broker_fd_ratio,
            disable_after_s=settings.disable_after_s,
        )
        self.canaries = CanaryBook()
        self.capacity: BrokerCapacity | None = None  # the broker's last reading (None: unreadable)
        # Alerts and notifications the broker has not taken yet (it refused publishes, or they were just
        # written down): sent, in order, once it takes them. Saved with the alert book.
        self._unsent = HeldPublishes(
            publisher, max_held=UNSENT_MAX, held=alert_state.unsent if alert_state else ()
        )
        # What fires, as the world was told (a restart goes on from the saved book).
        self.alerts = AlertBook(alert_state.firing if alert_state else None)
        self._alerts_saved: bytes | None = None
        self.dead_letters = dead_letters
        self.awaiting_retry = 0
        self.missing: dict[str, str | None] = {}  # queue or stream -> its endpoint (None: core)
        # Found missing since the last alert evaluation: the leader declares it again within the same
        # poll, so without this the alert would fire only if an evaluation happened to fall in between.
        self._missing_since_evaluation: dict[str, str | None] = {}
        self.live = False  # caught up with telemetry: records now move breakers (when leading)
        self.leader = False
        # Whether this monitor has tried for the lead once: until then an alert evaluation would take
        # into the book, untold, what a leader is about to tell.
        self._contended = False
        self._breaker_log = BreakerView()  # the breaker states as the log says (a standby mirrors them)
        self._outbox: asyncio.Queue[BreakerCommand] = asyncio.Queue()
        self._empty_since_s: dict[str, float] = {}  # retired queue -> when it was first seen empty
        self._unnamed_since_s: dict[str, float] = {}  # notifier -> when no endpoint named it any more
        self._probe = QueueProbe(broker)
        self.lanes_pending = 0  # ready messages in the lanes (read with the core queues)
        isolation = Isolation(
            broker, change_log, max_queues=settings.max_endpoint_queues, timeout_s=settings.connect_timeout_s
        )
        self.bindings = Bindings(
            broker, change_log, grace_s=settings.retired_queue_grace_s, timeout_s=settings.connect_timeout_s
        )
        self.registry.subscribe(self.bindings.on_change)
        self.bindings.seed()
        self.direct = Direct(
            broker, change_log, self.bindings, lambda: self.leader, timeout_s=settings.connect_timeout_s
        )
        self.registry.subscribe(self.direct.on_change)
        self.placements = Placements(
            broker, change_log, isolation, self.direct, self.health, slow_p95_ms=settings.slow_p95_ms,
            grace_s=settings.retired_queue_grace_s, timeout_s=settings.connect_timeout_s,
        )  # fmt: skip

    @property
    def blocked(self) -> bool:
        """The broker refuses this monitor's publishes (a memory or disk alarm)."""
        return self._broker.blocked

    # --- what the streams say --------------------------------------------------------------------

    def on_telemetry(self, message: Record) -> None:
        try:
            records = batch.validate_json(message.body)
        except ValidationError as exc:
            log.error("telemetry_unreadable", error=error_summary(exc))
            return
        now_s = time.time()
        moving = self.live and self.leader
        for record in records:
            for command in self.health.observe(record, now_s=now_s, live=moving):
                self._outbox.put_nowait(command)
            if isinstance(record, AttemptRecord):
                self.canaries.on_attempt(record)

    def on_breaker_log(self, message: Record) -> None:
        try:
            record = control_record.validate_json(message.body)
        except ValidationError as exc:
            log.error("control_record_unreadable", offset=offset_of(message), error=error_summary(exc))
            return
        changed = self._breaker_log.apply(record)
        if not self.leader:
            for endpoint_id in changed:
                self._mirror(endpoint_id)

    def restore_breakers(self) -> None:
        """At start: the breakers as the log says. When the log has a snapshot (some monitor led in the
        last minutes) it is the whole truth, so a breaker the checkpoint has open but the log no longer
        lists has closed since; without one, the log's commands are applied over the checkpoint."""
        if self._breaker_log.saw_snapshot:
            for endpoint_id in list(self.health.endpoints):
                self._mirror(endpoint_id)
        for command in self._breaker_log.commands():
            self.health.restore(command)

    def _mirror(self, endpoint_id: str) -> None:
        """Take the breaker state of an endpoint from the log (what the leader decided)."""
        command = self._breaker_log.state(endpoint_id)
        if command is not None:
            self.health.restore(command)
        elif endpoint_id in self.health.endpoints:
            health = self.health.endpoints[endpoint_id]
            health.breaker, health.command = Breaker(), None

    # --- leadership ------------------------------------------------------------------------------

    async def lead_when_possible(self, loop: Loop) -> None:
        """Hold the leader lock while this monitor's connection lives; otherwise stand by and try again
        every second. Losing the channel (or the connection) ends the leadership at once."""
        loop.mark_up()
        while True:
            async with self._broker.channel() as channel:
                try:
                    await channel.declare_queue(
                        topology.MONITOR_LEADER_LOCK, exclusive=True, timeout=CALL_TIMEOUT_S
                    )
                except aiormq.exceptions.ChannelLockedResource:
                    self._contended = True  # another monitor leads
                else:
                    self._contended = True
                    self._take_over()
                    try:
                        await until_closed(channel)
                    finally:
                        self._stand_by()
            loop.beat()
            await asyncio.sleep(LEADER_RETRY_S)

    def _take_over(self) -> None:
        # The breakers as the previous leader left them (the log), then this monitor decides.
        for endpoint_id in list(self.health.endpoints):
            self._mirror(endpoint_id)
        for command in self._breaker_log.commands():
            self.health.restore(command)
        for health in self.health.endpoints.values():
            # A probe asked for before this monitor led may have reported to nobody (its attempt record
            # lost with a connection): a half-open breaker gets a probe assigned afresh at the next tick
            # rather than after PROBE_TIMEOUT_S.
            health.probe_asked_at_s = 0.0
        self.direct.forget_bound()  # a route recorded by the leader before may not be bound yet
        self.leader = True
        LEADER.set(1)
        log.warning("monitor_leading", breakers_open=len(self._breaker_log.commands()))

    def _stand_by(self) -> None:
        if self.leader:
            log.warning("monitor_standing_by")
        self.leader = False
        LEADER.set(0)

    # --- the loops -----------------------------------------------------------------------------

    async def publish_commands(self, loop: Loop) -> None:
        loop.mark_up()
        while True:
            command = await self._outbox.get()
            loop.beat()
            if not self.leader:
                continue
            if command.state is BreakerState.OPEN:
                # Its events wait in a queue of its own while the breaker is open, not in its lane.
                await self.placements.isolate_for_breaker(command.endpoint_id)
            try:
                await self._publish_control(command)
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

    async def tick(self, loop: Loop) -> None:
        next_snapshot_s = next_evaluation_s = 0.0
        loop.mark_up()
        while True:
            loop.beat()
            now_s = time.time()
            if self.leader:
                for command in self.health.tick(now_s=now_s):
                    self._outbox.put_nowait(command)
                for endpoint_id in [] if self._broker.blocked else self.health.to_disable(now_s=now_s):
                    await self._disable(endpoint_id, now_s=now_s)
                if now_s >= next_snapshot_s:
                    with contextlib.suppress(*BROKER_ERRORS):  # the next one, in a few seconds
                        await self._publish_control(self.health.snapshot(now_s=now_s))
                    next_snapshot_s = now_s + SNAPSHOT_INTERVAL_S
            if now_s >= next_evaluation_s:
                # Alerts and metrics merge every endpoint's windows: every few ticks is enough.
                await self._alert(now_s=now_s)
                await self._export_metrics(now_s)
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
            await self._store.save(data, offset=offset - 1, identity=_telemetry_identity(self._broker))
        await self._save_alerts()

    async def poll_queues(self, loop: Loop) -> None:
        """Queue depths by passive declares; missing queues and streams found (and, when leading,
        declared again); queues left behind removed once they have stayed empty long enough."""
        loop.mark_up()
        while True:
            try:
                await self._poll_once()
            finally:
                await self._probe.close()
            loop.beat()
            await asyncio.sleep(self.settings.queue_poll_s)

    async def _poll_once(self) -> None:
        core = {name: await self._probe.depth(name) for name in topology.core_queues()}
        levels = (topology.delay_level(level) for level in range(topology.DELAY_BITS))
        self.awaiting_retry = sum(core[name] or 0 for name in levels)
        self.lanes_pending = sum(core[name] or 0 for name in topology.lane_queues())
        for name in topology.lane_queues():
            LANE_DEPTH.labels(name).set(core[name] or 0)
        missing: dict[str, str | None] = {name: None for name, depth in core.items() if depth is None}
        # Only endpoints with a queue of their own have a depth of their own; the others' events pass
        # through their lane (pending there, in lanes_pending).
        depths: dict[str, int | None] = {}
        for endpoint in self.registry.placements.with_queues():
            if not self.registry.placements.has_queue(endpoint.id):
                continue
            queue = topology.own_queue(endpoint)
            depth = depths[endpoint.id] = await self._probe.depth(queue)
            self.health.endpoint(endpoint.id).queue_depth = depth
            if depth is None and self.registry.placements.isolated(endpoint):
                missing[queue] = endpoint.id
        for endpoint_id, health in self.health.endpoints.items():
            if endpoint_id not in depths:
                health.queue_depth = None
        await self.placements.sweep(depths, leader=self.leader)
        await self.bindings.sweep(leader=self.leader)
        await self._sweep_retired()
        await self._sweep_notifiers()
        self.missing = missing
        self._missing_since_evaluation.update(missing)
        if missing and self.leader:
            await self._repair(missing)

    async def _repair(self, found_missing: dict[str, str | None]) -> None:
        for name, endpoint_id in sorted(found_missing.items(), key=lambda item: item[0]):
            log.error("queue_missing", queue=name, endpoint_id=endpoint_id, alert=True)
        # Not at once: the consumers of the queue deleted must have been told first (REDECLARE_AFTER_S).
        # A dispatcher that was told may have declared its queue of its own again meanwhile.
        await asyncio.sleep(topology.REDECLARE_AFTER_S)
        missing = {name: e for name, e in found_missing.items() if await self._probe.depth(name) is None}
        if not missing:
            return
        if any(endpoint_id is None for endpoint_id in missing.values()):
            try:
                await topology.declare(self._broker, self.settings.retention, timeout_s=REPAIR_WAIT_S)
            except topology.TopologyMissingError as exc:
                # A monitor with least privilege may not declare the core topology (only the ingest
                # does, at its start): the alert above stands; endpoint queues are still repaired.
                log.error("topology_not_repairable", detail=str(exc))
            else:
                await self._rebind_lanes({name for name in missing if topology.is_lane(name)})
        for endpoint_id in {endpoint_id for endpoint_id in missing.values() if endpoint_id}:
            endpoint = self.registry.get(endpoint_id)
            if endpoint is not None and self.registry.placements.isolated(endpoint):
                async with self._broker.channel() as channel:
                    await topology.declare_own_queue(channel, endpoint)
                self.direct.forget_bound()  # declared again without its direct route, if it had one
        log.warning("topology_repaired", declared=sorted(missing))

    async def _rebind_lanes(self, lanes: set[str]) -> None:
        """Lanes declared again (deleted by hand, lost with a node): every tenant pattern they held."""
        if not lanes:
            return
        async with self._broker.channel() as channel:
            for tenant in self.registry.rows.tenants():
                if topology.lane_of(tenant) in lanes:
                    await topology.bind_patterns(
                        channel, tenant, self.registry.subscriptions.patterns_needed(tenant)
                    )
        log.warning("lanes_bound_again", lanes=sorted(lanes))

    async def _sweep_retired(self) -> None:
        """Queues endpoints have left (a move, a deletion) are drained by the dispatchers; once one has
        stayed empty for the grace period, nothing can come back to it any more and it is removed."""
        since = datetime.now(UTC) - DELETED_WATCH_WINDOW
        retired = [
            name for endpoint in self.registry.placements.with_queues() for name in endpoint.retired_queues
        ]
        retired += [
            name
            for endpoint in self.registry.deletions.deleted_with_queues_since(since)
            for name in topology.endpoint_queues(endpoint)
        ]
        now_s = time.monotonic()
        for name in retired:
            depth = await self._probe.depth(name)
            if depth != 0:
                self._empty_since_s.pop(name, None)
                continue
            empty_since_s = self._empty_since_s.setdefault(name, now_s)
            if self.leader and now_s - empty_since_s >= self.settings.retired_queue_grace_s:
                async with self._broker.channel() as channel:
                    await channel.queue_delete(name, timeout=CALL_TIMEOUT_S)
                self._empty_since_s.pop(name, None)
                log.info("queue_removed", queue=name, endpoint_id=topology.endpoint_of(name))

    async def _sweep_notifiers(self) -> None:
        """A notifier no endpoint names any more (a notify_url changed or removed, its endpoints deleted)
        is removed once it has stayed unnamed for the grace period (named again meanwhile, it stays, its
        secret unchanged). Removed as an endpoint is deleted: what its queue still holds is dead-lettered,
        and the queue goes once drained (:meth:`_sweep_retired`)."""
        unnamed = {notifier.id: notifier for notifier in self._unnamed_notifiers()}
        for notifier_id in set(self._unnamed_since_s) - set(unnamed):
            del self._unnamed_since_s[notifier_id]
        now_s = time.monotonic()
        for notifier in unnamed.values():
            unnamed_since_s = self._unnamed_since_s.setdefault(notifier.id, now_s)
            if self.leader and now_s - unnamed_since_s >= self.settings.notifier_grace_s:
                await self._remove_notifier(notifier.id)

    def endpoints_listed(self, tenant: str | None) -> list[StoredEndpoint]:
        """What the status API and the dashboard list: a tenant's endpoints; across tenants, every one
        while there are at most ``LISTED_WHOLE``, past that those with telemetry or a queue of their own
        (among a million, an idle endpoint says nothing)."""
        if tenant is not None:
            return self.registry.rows.of_tenant(tenant)
        if len(self.registry) <= LISTED_WHOLE:
            return self.registry.rows.all()
        return list(self._endpoints_to_evaluate({}, {}).values())

    def _unnamed_notifiers(self) -> list[StoredEndpoint]:
        return notifications.unnamed_notifiers(
            self.registry.rows.of_tenant(notifications.OPERATOR_TENANT), self.registry.rows.notifier_named
        )

    async def _remove_notifier(self, notifier_id: str) -> None:
        # Up to date first: an endpoint may have named it a moment ago on an ingest.
        await self._change_log.sync(timeout_s=self.settings.connect_timeout_s)
        unnamed = {notifier.id: notifier for notifier in self._unnamed_notifiers()}
        notifier = unnamed.get(notifier_id)
        if notifier is None:
            return
        record = EndpointDeleted(
            change_id=new_id("chg"),
            at=datetime.now(UTC),
            endpoint_id=notifier.id,
            base_version=notifier.version,
        )
        try:
            await self._change_log.write(record, timeout_s=self.settings.connect_timeout_s)
        except StaleWriteError:
            return  # changed meanwhile (an ingest resumed it): looked at again at the next poll
        if not notifier.laned:
            async with self._broker.channel() as channel:
                await topology.unroute_legacy(channel, notifier)
        self._unnamed_since_s.pop(notifier.id, None)
        log.info("notifier_removed", endpoint_id=notifier.id, description=notifier.description)

    # --- actions -------------------------------------------------------------------------------

    async def _publish_control(self, record: ControlRecord) -> None:
        await self._publisher.publish(
            aio_pika.Message(
                control_record.dump_json(record),
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                message_id=new_id("ctl"),
            ),
            exchange=topology.CONTROL_EXCHANGE,
            routing_key="",
        )

    async def _disable(self, endpoint_id: str, *, now_s: float) -> None:
        """Open longer than the limit: disable the endpoint and tell its tenant with an event; then
        forget its breaker. In that order: a breaker closed while the endpoint is still active lets the
        dispatchers attempt what waits in its queue, and those failures opened the breaker of the
        disabled endpoint again, which told its tenant ``endpoint.failing`` after ``endpoint.disabled``."""
        log.info("endpoint_disabling", endpoint_id=endpoint_id)  # the write below may wait (a lost network)
        # A paused endpoint stays paused: its tenant stopped it, the breaker did not.
        endpoint = await self._change_log.disable(
            endpoint_id, unless=frozenset({EndpointStatus.PAUSED}), timeout_s=self.settings.connect_timeout_s
        )
        if endpoint is not None:
            await self._tell_disabled(endpoint)
        for command in self.health.reset(endpoint_id, now_s=now_s):
            self._outbox.put_nowait(command)

    async def _tell_disabled(self, endpoint: StoredEndpoint) -> None:
        """The tenant's event ``hookline.endpoint.disabled``, and the alert's log line."""
        now = endpoint.updated_at
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
        await self._publish_event(event)
        log.warning(
            "endpoint_disabled", endpoint_id=endpoint.id, tenant=endpoint.tenant, reason=reason, alert=True
        )

    async def _publish_event(self, event: Event) -> None:
        """To ``events``, as an upstream publishes (confirmed): delivered like any other event."""
        await self._publisher.publish(
            event_message(
                event, event.model_dump_json(exclude_none=True).encode(), accepted_at=event.occurred_at
            ),
            exchange=topology.EVENTS_EXCHANGE,
            routing_key=topology.event_routing_key(event.tenant, event.type),
        )

    def _canary_endpoints(self) -> list[str]:
        return [
            endpoint.id
            for endpoint in self.registry.rows.of_tenant(self.settings.canary_tenant)
            if endpoint.status is EndpointStatus.ACTIVE
        ]

    async def send_canaries(self, loop: Loop) -> None:
        """While leading, a canary event every HOOKLINE_CANARY_INTERVAL_S, if an endpoint takes them."""
        loop.mark_up()
        while True:
            loop.beat()
            if self.leader and self._canary_endpoints():
                now = datetime.now(UTC)
                canary = Event(
                    id=new_id("evt"), type=CANARY_TYPE, tenant=self.settings.canary_tenant, occurred_at=now,
                    data={"sent_at": now.isoformat()},
                )  # fmt: skip
                self.canaries.sending(canary.id)
                try:
                    await self._publish_event(canary)
                    CANARIES_SENT.inc()
                except BROKER_ERRORS as exc:
                    # Not sent is as good as not delivered: canary_late says so in a moment.
                    log.warning("canary_unpublished", error=type(exc).__name__)
            await asyncio.sleep(self.settings.canary_interval_s)

    async def _alert(self, *, now_s: float) -> None:
        """Evaluate the alerts; when leading, tell the world of each that fired or resolved since. What
        is told is written down (the book and the messages) before it is sent: a restart neither tells
        it twice nor forgets it."""
        if not self._contended:
            return  # not yet known whether this monitor leads: the book would take changes in untold
        current = await self._current_alerts(now_s=now_s)
        fired, resolved = self.alerts.update(current)
        if self.leader:  # a standby knows what fires (its API says so); the leader tells the world
            for state, changed in (("firing", fired), ("resolved", resolved)):
                for alert in changed:
                    self._publish_alert(alert, state, now_s)
                    self._notify(alert, state, now_s)
        await self._save_alerts()
        if self._unsent:
            await self._unsent.flush()
            await self._save_alerts()

    async def _save_alerts(self) -> None:
        """The alert book and the messages still to send, when they changed since the last save."""
        data = checkpoint.dump_alerts(self.alerts.firing, self._unsent.items())
        if data != self._alerts_saved:
            await self._store.save_alerts(data, identity=_alerts_identity(self._broker))
            self._alerts_saved = data

    def _endpoints_to_evaluate(
        self, recent_dead_letters: Mapping[str, int], missing: Mapping[str, str | None]
    ) -> dict[str, StoredEndpoint]:
        """The endpoints an alert may be about: those with telemetry, recent dead letters or a queue
        found missing, and those with queues of their own (a disabled endpoint's among them); never a
        walk over every registered endpoint."""
        ids = {*self.health.endpoints, *recent_dead_letters, *filter(None, missing.values())}
        found = {endpoint_id: e for endpoint_id in ids if (e := self.registry.get(endpoint_id)) is not None}
        return {**found, **{endpoint.id: endpoint for endpoint in self.registry.placements.with_queues()}}

    async def _current_alerts(self, *, now_s: float) -> dict[AlertKey, Alert]:
        recent = await self.dead_letters.counts_since(
            datetime.fromtimestamp(now_s, UTC) - timedelta(minutes=5)
        )
        missing, self._missing_since_evaluation = {**self._missing_since_evaluation, **self.missing}, {}
        return evaluate(
            self.health,
            self._endpoints_to_evaluate(recent, missing),
            recent_dead_letters=lambda endpoint_id: recent.get(endpoint_id, 0),
            missing=missing,
            others=[
                *broker_alerts(self.capacity, blocked=self._broker.blocked, policy=self.alert_policy),
                *self.canaries.alerts(
                    self._canary_endpoints(),
                    tenant=self.settings.canary_tenant,
                    now_s=now_s,
                    late_s=self.settings.canary_late_s,
                ),
            ],
            now_s=now_s,
            policy=self.alert_policy,
        )

    def _notify(self, alert: Alert, state: str, now_s: float) -> None:
        """Tell the endpoint's tenant, at its notify_url, through its notifier's queue (retried there)."""
        endpoint = self.registry.get(alert.endpoint_id) if alert.endpoint_id else None
        notice = notifications.notice_for(alert.name, state, endpoint)
        if notice is None or endpoint is None:
            return
        notifier_id = notifications.notifier_of(endpoint)
        notifier = self.registry.get(notifier_id) if notifier_id else None
        if notifier is None:
            log.warning("notifier_missing", endpoint_id=endpoint.id, notifier_id=notifier_id)
            return
        event = notifications.notification(
            notice, endpoint, alert.detail, now=datetime.fromtimestamp(now_s, UTC)
        )
        message = addressing.message(
            event.model_dump_json(exclude_none=True).encode(),
            event_id=event.id,
            endpoint_id=notifier.id,
            timestamp=event.occurred_at,
        )
        log.info(
            "notification",
            notice=notice.value,
            endpoint_id=endpoint.id,
            tenant=endpoint.tenant,
            notifier_id=notifier.id,
            event_id=event.id,
        )
        # To its address as it is now: a queue gone by the time it is sent makes it unroutable, and a
        # dispatcher forwards it (addressing.py).
        self._unsent.hold(
            message,
            exchange=topology.DELAY_DELIVERY,
            routing_key=topology.delay_routing_key(0, self.registry.placements.address(notifier)),
            what="notification",
        )

    def _publish_alert(self, alert: Alert, state: str, now_s: float) -> None:
        body = {
            "alert": alert.name,
            "state": state,
            "endpoint_id": alert.endpoint_id,
            "tenant": alert.tenant,
            "detail": alert.detail,
            "at": datetime.fromtimestamp(now_s, UTC).isoformat(),
        }
        log.warning("alert", **body)
        message = aio_pika.Message(
            orjson.dumps(body),
            content_type="application/json",
            message_id=new_id("alert"),
            type=f"{alert.name}.{state}",
        )
        assert message.message_id is not None
        self._sinks.send(message.message_id, body)
        self._unsent.hold(
            message, exchange=topology.ALERTS_EXCHANGE, routing_key=message.type or "", what="alert"
        )

    async def watch_broker(self, reader: CapacityReader, loop: Loop) -> None:
        """The broker's alarms, free disk and file handles, read every few seconds (for alerts, /metrics
        and /v1/status); without a source only the publishing connection's state tells of an alarm."""
        log.info("broker_capacity_source", source=reader.source, target=reader.target)
        loop.mark_up()
        while True:
            self.capacity = await reader.recent(max_age_s=0)
            _export_capacity(self.capacity)
            loop.beat()
            await asyncio.sleep(self.settings.broker_poll_s)

    async def _export_metrics(self, now_s: float) -> None:
        for gauge in (BREAKER_STATE, ENDPOINT_P95_MS, QUEUE_DEPTH, ALERTS_FIRING):
            gauge.clear()
        endpoints = self.health.endpoints
        for endpoint_id in series.chosen(
            (_standing(endpoint_id, health, now_s) for endpoint_id, health in endpoints.items()),
            max_endpoints=self.settings.metrics_max_endpoints,
        ):
            health = endpoints[endpoint_id]
            BREAKER_STATE.labels(endpoint_id).set(_STATE_VALUE[health.breaker.state])
            for window, stats in (("24h", health.day), ("5m", health.recent)):
                p95 = stats.total(now_s=now_s).percentile_ms(0.95)
                if p95 is not None:
                    ENDPOINT_P95_MS.labels(endpoint_id, window).set(p95)
            if health.queue_depth is not None:
                QUEUE_DEPTH.labels(endpoint_id).set(health.queue_depth)
        for name, _ in self.alerts.firing:
            ALERTS_FIRING.labels(name).inc()
        CANARY_LATENCY.clear()
        for endpoint_id, latency_s in self.canaries.latency_s.items():
            CANARY_LATENCY.labels(endpoint_id).set(latency_s)
        AWAITING_RETRY.set(self.awaiting_retry)
        DEAD_LETTERS.set(await self.dead_letters.count())
        QUEUES_MISSING.set(len(self.missing))


def _standing(endpoint_id: str, health: EndpointHealth, now_s: float) -> series.Standing:
    recent = health.recent.total(now_s=now_s)
    return series.Standing(
        endpoint_id=endpoint_id,
        needs_attention=health.breaker.state is not BreakerState.CLOSED
        or bool(health.queue_depth)
        or recent.failures + recent.permanent > 0,
        p95_recent_ms=health.p95_recent_ms(now_s),
        attempts_recent=recent.attempts,
    )


def _export_capacity(capacity: BrokerCapacity | None) -> None:
    readings: dict[prometheus_client.Gauge, int | None] = {}
    if capacity is not None:
        readings = {
            BROKER_MEMORY_ALARM: int(capacity.memory_alarm),
            BROKER_DISK_ALARM: int(capacity.disk_alarm),
            BROKER_DISK_FREE: capacity.disk_free_bytes,
            BROKER_DISK_FREE_LIMIT: capacity.disk_free_limit_bytes,
            BROKER_FD_USED: capacity.fd_used,
            BROKER_FD_LIMIT: capacity.fd_limit,
            BROKER_QUEUES: capacity.queues,
        }
    for gauge in BROKER_GAUGES:
        value = readings.get(gauge)
        gauge.set(float("nan") if value is None else value)  # NaN: not known (no source, or 4.x)


def _alerts_identity(broker: Broker) -> str:
    """Whose alert book: the monitors of one vhost tell of its endpoints and queues."""
    return f"{broker.vhost}/{topology.ALERTS_EXCHANGE}"


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


async def _load_alerts(store: checkpoint.CheckpointStore, broker: Broker) -> checkpoint.AlertState | None:
    """The alert book saved by this monitor before; without one, whatever fires now is told once more."""
    data = await store.read_alerts(_alerts_identity(broker))
    if data is None:
        return None
    try:
        state = checkpoint.load_alerts(data)
    except checkpoint.CheckpointError as exc:
        log.warning("alert_book_unusable", error=str(exc)[:200])
        return None
    log.info("alert_book_restored", firing=len(state.firing), unsent=len(state.unsent))
    return state


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
        broker, topology.BREAKER_LOG, monitor.on_breaker_log, publisher=publisher,
        start=datetime.now(UTC) - BREAKER_LOOKBACK, prefetch=100,
    )  # fmt: skip
    await follow_synced(supervisor, "breaker-log", breaker_log, timeout_s=wait_s)
    monitor.restore_breakers()
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
    supervisor.spawn("leadership", monitor.lead_when_possible)
    supervisor.spawn("breaker-commands", monitor.publish_commands)
    supervisor.spawn("tick", monitor.tick, stall_s=60)
    supervisor.spawn("queues", monitor.poll_queues, stall_s=120)
    supervisor.spawn("direct-routes", monitor.direct.run, stall_s=120)
    supervisor.spawn("checkpoint", partial(monitor.checkpoint_loop, telemetry), stall_s=120)
    supervisor.spawn("broker", partial(monitor.watch_broker, capacity), stall_s=120)
    if settings.canary_interval_s > 0:
        supervisor.spawn("canaries", monitor.send_canaries, stall_s=max(60, 3 * settings.canary_interval_s))


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
        restored = (health, await _load_alerts(store, broker))
        monitor = Monitor(settings, broker, publisher, change_log, dead_letters, sinks, store, restored)
        telemetry = await _catch_up(settings, broker, publisher, supervisor, monitor, dead_letters, offset)
        monitor.live = True
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
