"""The health monitor's Prometheus series, declared here, and their export: breakers, latency and queue
depths per endpoint (of the endpoints series.py chooses), alerts firing, canaries, what waits in the
delay queues and the lanes, dead letters, queues missing, the broker's capacity, and whether this
monitor leads. The parts set the series of what they alone see (the lead, lane depths, canaries sent);
:func:`export` sets the rest every few ticks, :func:`export_capacity` at each reading of the broker."""

from __future__ import annotations

from typing import TYPE_CHECKING

import prometheus_client

from hookline.health_monitor import series
from hookline.health_monitor.alerts import AlertBook
from hookline.health_monitor.health import EndpointHealth
from hookline.shared.broker.capacity import BrokerCapacity
from hookline.shared.contracts.control import BreakerState

if TYPE_CHECKING:  # state.py imports canary.py, which counts its canaries here
    from hookline.health_monitor.monitorstate import MonitorState

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


async def export(state: MonitorState, alerts: AlertBook, now_s: float) -> None:
    for gauge in (BREAKER_STATE, ENDPOINT_P95_MS, QUEUE_DEPTH, ALERTS_FIRING):
        gauge.clear()
    endpoints = state.health.endpoints
    for endpoint_id in series.chosen(
        (_standing(endpoint_id, health, now_s) for endpoint_id, health in endpoints.items()),
        max_endpoints=state.settings.metrics_max_endpoints,
    ):
        health = endpoints[endpoint_id]
        BREAKER_STATE.labels(endpoint_id).set(_STATE_VALUE[health.breaker.state])
        for window, stats in (("24h", health.day), ("5m", health.recent)):
            p95 = stats.total(now_s=now_s).percentile_ms(0.95)
            if p95 is not None:
                ENDPOINT_P95_MS.labels(endpoint_id, window).set(p95)
        if health.queue_depth is not None:
            QUEUE_DEPTH.labels(endpoint_id).set(health.queue_depth)
    for name, _ in alerts.firing:
        ALERTS_FIRING.labels(name).inc()
    CANARY_LATENCY.clear()
    for endpoint_id, latency_s in state.canaries.latency_s.items():
        CANARY_LATENCY.labels(endpoint_id).set(latency_s)
    AWAITING_RETRY.set(state.awaiting_retry)
    DEAD_LETTERS.set(await state.dead_letters.count())
    QUEUES_MISSING.set(len(state.missing))


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


def export_capacity(capacity: BrokerCapacity | None) -> None:
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
