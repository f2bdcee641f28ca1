"""Which alerts fire now: a pure function of the monitor's picture; and the book that turns a set of
conditions into "firing" once when a condition starts and "resolved" once when it ends."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from hookline.health_monitor.breaker import open_for_s
from hookline.health_monitor.health import EndpointHealth, Health
from hookline.shared.broker.capacity import QUORUM_QUEUE_FILE_HANDLES, BrokerCapacity
from hookline.shared.contracts.control import BreakerState
from hookline.shared.contracts.models import EndpointStatus, StoredEndpoint

AlertKey = tuple[str, str | None]


@dataclass(frozen=True)
class AlertPolicy:
    slow_p95_ms: float = 2_000.0
    oldest_pending_s: float = 1_800.0
    spike_min_count: int = 5  # 401/403 or 429 answers in the last 5 minutes...
    spike_min_ratio: float = 0.5  # ...that are at least this share of the attempts
    dead_letters_min: int = 1  # new dead letters in the last 5 minutes
    broker_disk_headroom_bytes: int = 5_000_000_000  # free disk above the broker's own limit
    broker_fd_ratio: float = 0.8  # share of the broker's file handles in use (or taken by queues)
    disable_after_s: float = 259_200.0  # open this long, an endpoint is disabled; warned at half of it


@dataclass(frozen=True)
class Alert:
    name: str
    endpoint_id: str | None
    tenant: str | None
    detail: str

    @property
    def key(self) -> AlertKey:
        return (self.name, self.endpoint_id)


def evaluate(
    health: Health,
    endpoints: Mapping[str, StoredEndpoint],
    *,
    recent_dead_letters: Callable[[str], int],
    missing: Mapping[str, str | None] = {},
    others: Sequence[Alert] = (),
    now_s: float,
    policy: AlertPolicy,
) -> dict[AlertKey, Alert]:
    """``missing``: queues and streams found missing (each mapped to its endpoint, None for the core
    ones every service needs); they are declared again, but whatever they held is lost. ``others``:
    alerts decided elsewhere (:func:`broker_alerts`, the canaries')."""
    alerts: list[Alert] = [
        Alert("topology_missing", None, None, f"{name} was missing and has been declared again")
        for name, endpoint_id in sorted(missing.items()) if endpoint_id is None
    ]  # fmt: skip
    alerts += others
    missing_endpoints = {endpoint_id: name for name, endpoint_id in missing.items() if endpoint_id}
    for endpoint_id, endpoint in endpoints.items():
        tenant = endpoint.tenant

        def alert(name: str, detail: str, endpoint_id: str = endpoint_id, tenant: str = tenant) -> None:
            alerts.append(Alert(name, endpoint_id, tenant, detail))

        if endpoint.status is EndpointStatus.DISABLED:
            alert("endpoint_disabled", "the endpoint is disabled; nothing is delivered until it is resumed")
        if endpoint_id in missing_endpoints:
            alert("queue_missing", f"its queue {missing_endpoints[endpoint_id]} was missing; declared again")
        dead = recent_dead_letters(endpoint_id)
        if dead >= policy.dead_letters_min:
            alert("dead_letters_growing", f"{dead} new dead letters in the last 5 minutes")
        state = health.endpoints.get(endpoint_id)
        if state is None:
            continue
        for name, detail in _failing(endpoint, state, now_s=now_s, policy=policy):
            alert(name, detail)
        p95 = state.p95_recent_ms(now_s)
        if p95 is not None and p95 > policy.slow_p95_ms:
            alert(
                "slow_endpoint",
                f"p95 {p95:.0f} ms over the last 5 minutes (threshold {policy.slow_p95_ms:.0f} ms)",
            )
        oldest = state.oldest_pending_s(now_s)
        if oldest is not None and oldest > policy.oldest_pending_s:
            alert("oldest_pending", f"an event has waited {oldest / 60:.0f} min without being delivered")
        recent = state.recent.total(now_s=now_s)
        for name, count, what in (
            ("credentials_rejected", recent.auth_rejected, "401/403 (credentials changed?)"),
            ("rate_limited", recent.rate_limited, "429 (rate limited)"),
        ):
            if count >= policy.spike_min_count and count >= policy.spike_min_ratio * recent.attempts:
                alert(name, f"{count} of {recent.attempts} attempts in 5 minutes answered {what}")
    return {alert.key: alert for alert in alerts}


def _failing(
    endpoint: StoredEndpoint, state: EndpointHealth, *, now_s: float, policy: AlertPolicy
) -> list[tuple[str, str]]:
    """An open breaker, and (at half the time after which the endpoint is disabled) the warning. Not
    for a disabled endpoint: nothing is attempted there, ``endpoint_disabled`` says so, and a breaker
    opened again by attempts that were under way as it was disabled must not tell its tenant
    ``endpoint.failing`` after ``endpoint.disabled``."""
    if state.breaker.state is BreakerState.CLOSED or endpoint.status is EndpointStatus.DISABLED:
        return []
    failing = [
        (
            "breaker_open",
            f"circuit breaker {state.breaker.state.value} after {state.breaker.consecutive_failures} failures",
        )
    ]
    open_s = open_for_s(state.breaker, now_s=now_s)
    if endpoint.status is EndpointStatus.ACTIVE and open_s >= policy.disable_after_s / 2:
        disable_at = datetime.fromtimestamp(now_s - open_s + policy.disable_after_s, UTC)
        failing.append(
            (
                "endpoint_disabling",
                f"failing for {open_s / 3600:.1f} h: disabled at {disable_at:%Y-%m-%d %H:%M:%SZ} "
                "unless it recovers",
            )
        )
    return failing


def broker_alerts(capacity: BrokerCapacity | None, *, blocked: bool, policy: AlertPolicy) -> list[Alert]:
    """The broker's resources: its alarms (every publisher is blocked while one is raised), the disk
    and file handles running out before that. ``capacity`` is None when the broker's numbers cannot be
    read (no management API or local CLI): then only ``blocked``, the monitor's own connection being
    refused publishes, tells of an alarm."""

    def alert(name: str, detail: str) -> Alert:
        return Alert(name, None, None, detail)

    if capacity is None:
        return (
            [alert("broker_blocked", "the broker refuses publishes (a memory or disk alarm)")]
            if blocked
            else []
        )
    alerts = []
    nodes = ", ".join(capacity.nodes) or "the broker"
    if capacity.memory_alarm:
        alerts.append(alert("broker_memory_alarm", f"memory alarm on {nodes}: every publisher is blocked"))
    if capacity.disk_alarm:
        alerts.append(alert("broker_disk_alarm", f"disk alarm on {nodes}: every publisher is blocked"))
    if blocked and not (capacity.memory_alarm or capacity.disk_alarm):
        alerts.append(alert("broker_blocked", "the broker refuses publishes, yet reports no alarm here"))
    headroom = capacity.disk_headroom_bytes
    if headroom is not None and not capacity.disk_alarm and headroom < policy.broker_disk_headroom_bytes:
        alerts.append(
            alert(
                "broker_disk_low",
                f"{headroom / 1e9:.1f} GB of disk left before the broker's limit blocks every publisher",
            )
        )
    if (
        capacity.fd_limit
        and capacity.fd_used is not None
        and capacity.fd_used >= policy.broker_fd_ratio * capacity.fd_limit
    ):
        alerts.append(
            alert(
                "broker_file_handles",
                f"{capacity.fd_used} of {capacity.fd_limit} file handles in use: near the limit the broker "
                "stops accepting connections",
            )
        )
    if (
        capacity.fd_limit
        and capacity.queues is not None
        and capacity.queues * QUORUM_QUEUE_FILE_HANDLES >= policy.broker_fd_ratio * capacity.fd_limit
    ):
        alerts.append(
            alert(
                "broker_queue_capacity",
                f"{capacity.queues} queues for {capacity.fd_limit} file handles: RabbitMQ 3.x accounts "
                f"{QUORUM_QUEUE_FILE_HANDLES} for each quorum queue; raise the broker's file limit before "
                "adding endpoints",
            )
        )
    return alerts


class AlertBook:
    """Deduplicates: each condition fires once while it lasts and resolves once when it ends."""

    def __init__(self, firing: Mapping[AlertKey, Alert] | None = None) -> None:
        self.firing: dict[AlertKey, Alert] = dict(firing or {})

    def update(self, current: Mapping[AlertKey, Alert]) -> tuple[list[Alert], list[Alert]]:
        fired = [alert for key, alert in current.items() if key not in self.firing]
        resolved = [alert for key, alert in self.firing.items() if key not in current]
        self.firing = dict(current)
        return fired, resolved
