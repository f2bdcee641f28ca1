"""The health monitor's status API bodies: what the monitor answers and ``hookline status`` (and the
dashboard) read, one definition for both sides."""

from __future__ import annotations

from hookline.shared.broker.capacity import BrokerCapacity
from hookline.shared.contracts.control import BreakerState
from hookline.shared.contracts.models import Model


class BrokerStatus(Model):
    blocked: bool  # the broker refuses this monitor's publishes (a memory or disk alarm)
    capacity: BrokerCapacity | None  # its alarms, disk and file handles; None: not readable from here


class Summary(Model):
    pending: int  # ready in the endpoint queues
    awaiting_retry: int  # in the delay queues
    in_flight: int  # being attempted by the dispatchers (their last heartbeats)
    dead_letter: int
    delivered_last_hour: int
    failed_last_hour: int  # attempts that failed (retried or permanent)
    oldest_pending_age_s: float | None
    mean_delivery_ms: float | None  # mean attempt duration over the last hour
    endpoints: int
    breakers_open: int
    alerts_firing: int
    dispatchers: int
    leader: bool  # this monitor leads (moves breakers, publishes alerts); a standby mirrors it
    broker: BrokerStatus


class Percentiles(Model):
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    samples: int


class EndpointHealthView(Model):
    endpoint_id: str
    tenant: str | None
    status: str | None
    breaker_state: BreakerState
    breaker_cooldown_s: float  # the current cooldown; doubles with every failed probe
    consecutive_failures: int
    slow: bool  # p95 over the last 5 minutes above HOOKLINE_SLOW_P95_MS
    p50_ms: float | None  # over 24 h
    p95_ms: float | None
    p99_ms: float | None
    samples: int
    last_5m: Percentiles
    success_rate: float | None
    timeout_rate: float | None
    attempts: int
    dead_lettered: int
    retry_depth: int  # the highest attempt number seen
    queue_depth: int | None
    oldest_pending_age_s: float | None
    # Why it is delivered from a queue of its own (None: from its lane), and whether past the bound on
    # those it is held in a shared holding lane instead.
    isolation: str | None = None
    held: bool = False
    # Its queue of its own bound to events for its patterns in place of its lane (a direct route; an
    # ordered endpoint's always).
    routed_directly: bool = False


class TypeHealthView(Model):
    type: str
    last_24h: Percentiles
    last_5m: Percentiles


class AlertView(Model):
    alert: str
    endpoint_id: str | None
    tenant: str | None
    detail: str
