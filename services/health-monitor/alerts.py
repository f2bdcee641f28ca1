"""Which alerts fire now: a pure function of the monitor's picture; and the book that turns a set of
conditions into "firing" once when a condition starts and "resolved" once when it ends."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hookline.health_monitor.health import Health
from hookline.shared.control import BreakerState
from hookline.shared.models import EndpointStatus, StoredEndpoint

AlertKey = tuple[str, str | None]


@dataclass(frozen=True)
class AlertPolicy:
    slow_p95_ms: float = 2_000.0
    oldest_pending_s: float = 1_800.0
    spike_min_count: int = 5  # 401/403 or 429 answers in the last 5 minutes...
    spike_min_ratio: float = 0.5  # ...that are at least this share of the attempts
    dead_letters_min: int = 1  # new dead letters in the last 5 minutes


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
    now_s: float,
    policy: AlertPolicy,
) -> dict[AlertKey, Alert]:
    """``missing``: queues and streams found missing (each mapped to its endpoint, None for the core
    ones every service needs); they are declared again, but whatever they held is lost."""
    alerts: list[Alert] = [
        Alert("topology_missing", None, None, f"{name} was missing and has been declared again")
        for name, endpoint_id in sorted(missing.items()) if endpoint_id is None
    ]  # fmt: skip
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
        if state.breaker.state is not BreakerState.CLOSED:
            alert(
                "breaker_open",
                f"circuit breaker {state.breaker.state.value} after {state.breaker.consecutive_failures} failures",
            )
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


class AlertBook:
    """Deduplicates: each condition fires once while it lasts and resolves once when it ends."""

    def __init__(self) -> None:
        self.firing: dict[AlertKey, Alert] = {}

    def update(self, current: Mapping[AlertKey, Alert]) -> tuple[list[Alert], list[Alert]]:
        fired = [alert for key, alert in current.items() if key not in self.firing]
        resolved = [alert for key, alert in self.firing.items() if key not in current]
        self.firing = dict(current)
        return fired, resolved
