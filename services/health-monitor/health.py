"""The health monitor's picture of every endpoint, built from telemetry; time is passed in.

:meth:`Health.observe` takes each telemetry record (live, or replayed from the log after a restart),
:meth:`Health.tick` lets time pass. Both return the breaker commands to publish; the I/O shell
publishes them. Only live records move breakers: replaying the log rebuilds statistics, while the
breaker states come back from the monitor's own breaker log. Which dispatcher probes a half-open
endpoint is probing.py's choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hookline.health_monitor import breaker as breakers
from hookline.health_monitor.breaker import Breaker, BreakerPolicy
from hookline.health_monitor.probing import PROBE_TIMEOUT_S, choose_prober, declined
from hookline.health_monitor.stats import RollingStats
from hookline.shared.contracts.control import BreakerCommand, BreakerSnapshot, BreakerState
from hookline.shared.contracts.telemetry import (
    ASIDE_KINDS,
    AttemptRecord,
    Deferral,
    Heartbeat,
    Outcome,
    TelemetryRecord,
)

DAY_S, HOUR_S = 86_400, 3_600
RECENT_S, MINUTE_S = 300, 60
#: Events awaiting a retry that are remembered per endpoint, about 250 bytes each (the first ones survive:
#: the oldest pending is among them as long as the endpoint delivers roughly in order). Only the age of
#: the oldest is asked of them; 50,000 per endpoint were 12 MB for each failing endpoint.
MAX_TRACKED_RETRIES = 1_000
#: The event types whose statistics are kept apart; the records of any other count under OTHER_TYPES.
MAX_TRACKED_TYPES = 1_000
#: The bucket of the types beyond the cap (not a valid type name: no type can collide with it).
OTHER_TYPES = "(other)"
#: An event awaiting a retry with no news for this long is forgotten: its last records were lost (or its
#: endpoint deleted), and a monitor that rebuilt from the 24 h telemetry log would not know it either.
RETRY_FORGET_S = DAY_S
#: A dispatcher silent this long is not asked to probe.
DISPATCHER_STALE_S = 15.0
#: A dispatcher silent this long is forgotten (replicas come and go with new ids).
DISPATCHER_FORGET_S = 3_600.0
#: Fewer samples than this in the short window say nothing about p95.
MIN_SAMPLES = 5


@dataclass(frozen=True)
class HealthPolicy:
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    slow_p95_ms: float = 2_000.0  # flagged (and alerted) above this
    very_slow_p95_ms: float = 5_000.0  # above this each failure holds a worker for long: open sooner
    very_slow_threshold: int = 3
    disable_after_s: float = 259_200.0  # an endpoint open this long is disabled
    max_types: int = MAX_TRACKED_TYPES  # event types with statistics of their own


@dataclass
class EndpointHealth:
    day: RollingStats = field(default_factory=lambda: RollingStats(window_s=DAY_S, slot_s=HOUR_S))
    hour: RollingStats = field(default_factory=lambda: RollingStats(window_s=HOUR_S, slot_s=RECENT_S))
    recent: RollingStats = field(default_factory=lambda: RollingStats(window_s=RECENT_S, slot_s=MINUTE_S))
    breaker: Breaker = field(default_factory=Breaker)
    command: BreakerCommand | None = None  # the last one published
    # Event id -> (first attempt, last record) of the events awaiting a retry, in order of last record.
    retrying: dict[str, tuple[float, float]] = field(default_factory=dict)
    queue_depth: int | None = None
    last_attempt_at_s: float | None = None
    probe_asked_at_s: float = 0.0  # when a dispatcher was last asked to probe

    def p95_recent_ms(self, now_s: float) -> float | None:
        recent = self.recent.total(now_s=now_s)
        return recent.percentile_ms(0.95) if recent.attempts >= MIN_SAMPLES else None

    def oldest_pending_s(self, now_s: float) -> float | None:
        """Age of the oldest event still owed to this endpoint, as far as telemetry shows."""
        oldest = min((first_s for first_s, _ in self.retrying.values()), default=None)
        opened_at_s = self.breaker.first_opened_at_s
        if self.breaker.state is not BreakerState.CLOSED and opened_at_s is not None and self.queue_depth:
            # Whatever is queued has waited at least since the breaker opened.
            oldest = min(oldest or now_s, opened_at_s)
        return round(now_s - oldest, 3) if oldest is not None else None


@dataclass
class TypeHealth:
    day: RollingStats = field(default_factory=lambda: RollingStats(window_s=DAY_S, slot_s=HOUR_S))
    recent: RollingStats = field(default_factory=lambda: RollingStats(window_s=RECENT_S, slot_s=MINUTE_S))
    last_attempt_at_s: float | None = None


class Health:
    def __init__(self, policy: HealthPolicy) -> None:
        self.policy = policy
        self.endpoints: dict[str, EndpointHealth] = {}
        self.types: dict[str, TypeHealth] = {}
        self.dispatchers: dict[str, Heartbeat] = {}
        self._last_version = 0
        # Half-open endpoint -> the dispatchers that were asked to probe it and did not take it on.
        self._passed_over: dict[str, set[str]] = {}

    def endpoint(self, endpoint_id: str) -> EndpointHealth:
        health = self.endpoints.get(endpoint_id)
        if health is None:
            health = self.endpoints[endpoint_id] = EndpointHealth()
        return health

    def type_health(self, event_type: str) -> TypeHealth:
        """The statistics of ``event_type``, or of OTHER_TYPES once ``policy.max_types`` other types have
        statistics of their own: memory is bounded however many types upstreams publish. A type counted
        under OTHER_TYPES gets a place of its own when one frees up (a type a day without attempts)."""
        types = self.types.get(event_type)
        if types is None:
            if len(self.types) - (OTHER_TYPES in self.types) >= self.policy.max_types:
                event_type = OTHER_TYPES
                types = self.types.get(event_type)
            if types is None:
                types = self.types[event_type] = TypeHealth()
        return types

    def observe(self, record: TelemetryRecord, *, now_s: float, live: bool) -> list[BreakerCommand]:
        if isinstance(record, Heartbeat):
            self.dispatchers[record.dispatcher_id] = record
            return []
        if isinstance(record, Deferral) or record.attempt_kind in ASIDE_KINDS:
            return []  # by hand, a verification or a test: not the endpoint's delivery traffic
        health = self.endpoint(record.endpoint_id)
        health.day.add(record, now_s=now_s)
        health.hour.add(record, now_s=now_s)
        health.recent.add(record, now_s=now_s)
        types = self.type_health(record.type)
        types.day.add(record, now_s=now_s)
        types.recent.add(record, now_s=now_s)
        types.last_attempt_at_s = max(types.last_attempt_at_s or 0, record.at_s)
        health.last_attempt_at_s = max(health.last_attempt_at_s or 0, record.at_s)
        if record.outcome is Outcome.RETRY and record.dead_letter_reason is None:
            known = health.retrying.pop(record.event_id, None)
            if known is not None or len(health.retrying) < MAX_TRACKED_RETRIES:
                # Re-inserted at the end, so that the oldest news comes first for prune().
                last_s = record.at_s if known is None else max(record.at_s, known[1])
                health.retrying[record.event_id] = (record.first_attempt_at_s, last_s)
        else:
            health.retrying.pop(record.event_id, None)
        if not live:
            return []
        return self._breaker_result(record, health, now_s)

    def _breaker_result(
        self, record: AttemptRecord, health: EndpointHealth, now_s: float
    ) -> list[BreakerCommand]:
        if health.breaker.state is BreakerState.HALF_OPEN and not record.probe:
            return []  # only the probe decides a half-open breaker
        # A 4xx or 410 is an answer from a live endpoint: for the breaker, that is not a failure.
        success = record.outcome is not Outcome.RETRY
        before = health.breaker
        health.breaker = breakers.record(
            before,
            success=success,
            now_s=now_s,
            policy=self.policy.breaker,
            # The threshold needs the recent p95 (a merge and a sort): only worth it for a failure.
            threshold=self.policy.breaker.failure_threshold if success else self.threshold(health, now_s),
        )
        return self._command_if_changed(record.endpoint_id, health, before, probe_by=None, now_s=now_s)

    def threshold(self, health: EndpointHealth, now_s: float) -> int:
        p95 = health.p95_recent_ms(now_s)
        if p95 is not None and p95 > self.policy.very_slow_p95_ms:
            return min(self.policy.very_slow_threshold, self.policy.breaker.failure_threshold)
        return self.policy.breaker.failure_threshold

    def tick(self, *, now_s: float) -> list[BreakerCommand]:
        """Cooldowns that ended become half-open with a probe assigned; a probe whose dispatcher
        went silent is reassigned."""
        commands: list[BreakerCommand] = []
        live = self.live_dispatchers(now_s)
        for endpoint_id, health in self.endpoints.items():
            before = health.breaker
            health.breaker = breakers.tick(before, now_s=now_s)
            if health.breaker.state is not BreakerState.HALF_OPEN:
                self._passed_over.pop(endpoint_id, None)
                continue
            prober = health.command.probe_by if health.command else None
            waiting_s = now_s - health.probe_asked_at_s
            beat = self.dispatchers.get(prober) if prober is not None else None
            if prober is not None and declined(beat, health.command, asked_at_s=health.probe_asked_at_s):
                self._passed_over.setdefault(endpoint_id, set()).add(prober)
            elif before.state is BreakerState.HALF_OPEN and prober in live and waiting_s < PROBE_TIMEOUT_S:
                continue
            if not live:
                continue  # nobody to probe: try again next tick
            # A new prober when the cooldown has just ended, when the last one went silent or did not
            # take the probe on, or when its probe has not reported back in time (it found nothing to
            # deliver, or lost it).
            probe_by = choose_prober(endpoint_id, live, self.dispatchers, self._passed_over, now_s=now_s)
            health.probe_asked_at_s = now_s
            commands += self._command_if_changed(endpoint_id, health, before, probe_by=probe_by, now_s=now_s)
        return commands

    def live_dispatchers(self, now_s: float) -> list[str]:
        return sorted(d for d, beat in self.dispatchers.items() if now_s - beat.at_s <= DISPATCHER_STALE_S)

    def to_disable(self, *, now_s: float) -> list[str]:
        """Endpoints whose breaker has been open longer than the policy allows."""
        return [
            endpoint_id
            for endpoint_id, health in self.endpoints.items()
            if breakers.open_for_s(health.breaker, now_s=now_s) >= self.policy.disable_after_s
        ]

    def reset(self, endpoint_id: str, *, now_s: float) -> list[BreakerCommand]:
        """Forget an endpoint's breaker (it was disabled or deleted): closed, and say so."""
        health = self.endpoint(endpoint_id)
        before, health.breaker = health.breaker, Breaker()
        return self._command_if_changed(endpoint_id, health, before, probe_by=None, now_s=now_s)

    def _version(self, now_s: float) -> int:
        # Milliseconds since the epoch, and always increasing: versions stay ahead of those a
        # dispatcher read from an earlier monitor, even after the breaker log has expired.
        self._last_version = max(self._last_version + 1, int(now_s * 1000))
        return self._last_version

    def _command_if_changed(
        self, endpoint_id: str, health: EndpointHealth, before: Breaker, *, probe_by: str | None, now_s: float
    ) -> list[BreakerCommand]:
        after = health.breaker
        if after.state is before.state and probe_by is None:
            return []
        health.command = BreakerCommand(
            endpoint_id=endpoint_id,
            state=after.state,
            version=self._version(now_s),
            probe_by=probe_by,
            opened_at_s=after.opened_at_s,
            first_opened_at_s=after.first_opened_at_s,
            cooldown_s=after.cooldown_s,
            consecutive_failures=after.consecutive_failures,
        )
        return [health.command]

    def snapshot(self, *, now_s: float) -> BreakerSnapshot:
        return BreakerSnapshot(
            version=self._version(now_s),
            breakers=[
                health.command
                for health in self.endpoints.values()
                if health.command is not None and health.command.state is not BreakerState.CLOSED
            ],
        )

    def restore(self, command: BreakerCommand) -> None:
        """A breaker state read back from the breaker log after a restart."""
        health = self.endpoint(command.endpoint_id)
        health.command = command
        health.breaker = Breaker(
            state=command.state,
            consecutive_failures=command.consecutive_failures,
            opened_at_s=command.opened_at_s,
            first_opened_at_s=command.first_opened_at_s,
            cooldown_s=command.cooldown_s,
        )
        self._last_version = max(self._last_version, command.version)

    def prune(self, *, now_s: float) -> None:
        """Forget what no window, breaker or retry needs any more, so that memory (and the checkpoint)
        is bounded by the endpoints, types and dispatchers of the last day, not by history."""
        self.dispatchers = {
            d: beat for d, beat in self.dispatchers.items() if now_s - beat.at_s <= DISPATCHER_FORGET_S
        }
        for endpoint_id, health in list(self.endpoints.items()):
            _forget_stale_retries(health.retrying, before_s=now_s - RETRY_FORGET_S)
            if (
                not _in_window(health.day, health.last_attempt_at_s, now_s=now_s)
                and health.breaker.state is BreakerState.CLOSED
                and not health.retrying
                and not health.queue_depth  # e.g. a disabled endpoint's queue: the status counts it
            ):
                del self.endpoints[endpoint_id]
        for event_type, types in list(self.types.items()):
            if not _in_window(types.day, types.last_attempt_at_s, now_s=now_s):
                del self.types[event_type]


def _in_window(window: RollingStats, last_attempt_at_s: float | None, *, now_s: float) -> bool:
    """Whether the newest record is still inside the window. The day window is the longest, and every
    record is offered to all windows: when the newest one has left the day window, they all have."""
    if last_attempt_at_s is None:
        return False
    return (
        int(last_attempt_at_s // window.slot_s)
        > int(now_s // window.slot_s) - window.window_s // window.slot_s
    )


def _forget_stale_retries(retrying: dict[str, tuple[float, float]], *, before_s: float) -> None:
    # In order of last record (observe() re-inserts), so the stale ones are at the front: one pass that
    # stops at the first fresh one (records arrive nearly in time order; a straggler waits a round).
    stale: list[str] = []
    for event_id, (_, last_s) in retrying.items():
        if last_s >= before_s:
            break
        stale.append(event_id)
    for event_id in stale:
        del retrying[event_id]
