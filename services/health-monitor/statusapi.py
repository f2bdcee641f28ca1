"""The monitor's API: the one-row summary, endpoint and event-type health, dead-letter analysis, alerts."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from hookline.health_monitor.health import EndpointHealth, Health
from hookline.health_monitor.monitor import Monitor
from hookline.health_monitor.stats import Stats
from hookline.shared.broker import placement
from hookline.shared.contracts.control import BreakerState
from hookline.shared.contracts.deadletters import DeadLetterAnalysis
from hookline.shared.contracts.models import StoredEndpoint
from hookline.shared.contracts.status import (
    AlertView,
    BrokerStatus,
    EndpointHealthView,
    Percentiles,
    Summary,
    TypeHealthView,
)
from hookline.shared.runtime.api import ApiError

router = APIRouter(prefix="/v1", tags=["status"])


def monitor_state(request: Request) -> Monitor:
    monitor: Monitor = request.app.state.monitor
    return monitor


State = Annotated[Monitor, Depends(monitor_state)]


def percentiles(stats: Stats) -> Percentiles:
    return Percentiles(
        p50_ms=stats.percentile_ms(0.50),
        p95_ms=stats.percentile_ms(0.95),
        p99_ms=stats.percentile_ms(0.99),
        samples=stats.attempts,
    )


def endpoint_view(
    monitor: Monitor, endpoint_id: str, endpoint: StoredEndpoint | None, now_s: float
) -> EndpointHealthView:
    health = monitor.health.endpoints.get(endpoint_id) or EndpointHealth()
    day = health.day.total(now_s=now_s)
    p95_recent = health.p95_recent_ms(now_s)
    where = monitor.registry.placements.placement(endpoint_id)
    isolation = placement.reason(endpoint, where) if endpoint is not None else None
    return EndpointHealthView(
        endpoint_id=endpoint_id,
        tenant=endpoint.tenant if endpoint else None,
        status=endpoint.status.value if endpoint else None,
        breaker_state=health.breaker.state,
        breaker_cooldown_s=health.breaker.cooldown_s,
        consecutive_failures=health.breaker.consecutive_failures,
        slow=p95_recent is not None and p95_recent > monitor.settings.slow_p95_ms,
        p50_ms=day.percentile_ms(0.50),
        p95_ms=day.percentile_ms(0.95),
        p99_ms=day.percentile_ms(0.99),
        samples=day.attempts,
        last_5m=percentiles(health.recent.total(now_s=now_s)),
        success_rate=day.rate(day.successes),
        timeout_rate=day.rate(day.timeouts),
        attempts=day.attempts,
        dead_lettered=day.dead_letters,
        retry_depth=day.max_attempt,
        # Without a queue of its own, nothing waits for this endpoint alone (its events pass its lane).
        queue_depth=health.queue_depth if monitor.registry.placements.has_queue(endpoint_id) else 0,
        oldest_pending_age_s=health.oldest_pending_s(now_s),
        isolation=isolation,
        held=endpoint is not None and monitor.registry.placements.held(endpoint),
        routed_directly=endpoint is not None
        and (endpoint.straight or monitor.registry.placements.direct(endpoint) is not None),
    )


def last_hour(health: Health, *, now_s: float) -> Stats:
    """Every endpoint's last hour, merged (the summary's delivered, failed and mean)."""
    merged = Stats()
    for endpoint in health.endpoints.values():
        merged.merge(endpoint.hour.total(now_s=now_s))
    return merged


@router.get("/status", response_model=Summary)
async def status(monitor: State) -> Summary:
    now_s = time.time()
    health = monitor.health
    hour = last_hour(health, now_s=now_s)
    live = set(health.live_dispatchers(now_s))
    ages = [age for h in health.endpoints.values() if (age := h.oldest_pending_s(now_s)) is not None]
    return Summary(
        pending=sum(h.queue_depth or 0 for h in health.endpoints.values()) + monitor.state.lanes_pending,
        awaiting_retry=monitor.state.awaiting_retry,
        in_flight=sum(beat.in_flight for d, beat in health.dispatchers.items() if d in live),
        dead_letter=await monitor.dead_letters.count(),
        delivered_last_hour=hour.successes,
        failed_last_hour=hour.failures + hour.permanent,
        oldest_pending_age_s=max(ages, default=None),
        mean_delivery_ms=hour.mean_ms(),
        endpoints=len(monitor.registry),
        breakers_open=sum(h.breaker.state is not BreakerState.CLOSED for h in health.endpoints.values()),
        alerts_firing=len(monitor.alerting.alerts.firing),
        dispatchers=len(live),
        leader=monitor.state.leader,
        broker=BrokerStatus(blocked=monitor.blocked, capacity=monitor.state.capacity),
    )


@router.get("/endpoints/health", response_model=list[EndpointHealthView])
async def endpoints_health(
    monitor: State,
    tenant: str | None = None,
    degrading: Annotated[
        bool, Query(description="only slow endpoints and those whose breaker is not closed")
    ] = False,
) -> list[EndpointHealthView]:
    """Every endpoint's health, the slowest (24 h p95) first."""
    now_s = time.time()
    views = [
        endpoint_view(monitor, endpoint.id, endpoint, now_s) for endpoint in monitor.endpoints_listed(tenant)
    ]
    if degrading:
        views = [v for v in views if v.slow or v.breaker_state is not BreakerState.CLOSED]
    return sorted(views, key=lambda view: -(view.p95_ms or 0))


@router.get("/endpoints/{endpoint_id}/health", response_model=EndpointHealthView)
async def endpoint_health(endpoint_id: str, monitor: State) -> EndpointHealthView:
    endpoint = monitor.registry.deletions.last_known(endpoint_id)
    if endpoint is None and endpoint_id not in monitor.health.endpoints:
        raise ApiError(404, "not_found", f"no endpoint {endpoint_id}")
    return endpoint_view(monitor, endpoint_id, endpoint, time.time())


@router.get("/types/health", response_model=list[TypeHealthView])
async def types_health(monitor: State) -> list[TypeHealthView]:
    now_s = time.time()
    return [
        TypeHealthView(
            type=event_type,
            last_24h=percentiles(health.day.total(now_s=now_s)),
            last_5m=percentiles(health.recent.total(now_s=now_s)),
        )
        for event_type, health in sorted(monitor.health.types.items())
    ]


@router.get("/dead-letters/analysis", response_model=list[DeadLetterAnalysis])
async def dead_letter_analysis(monitor: State, tenant: str | None = None) -> list[DeadLetterAnalysis]:
    return await monitor.dead_letters.analysis(tenant=tenant)


@router.get("/alerts", response_model=list[AlertView])
async def alerts(monitor: State) -> list[AlertView]:
    return [
        AlertView(alert=a.name, endpoint_id=a.endpoint_id, tenant=a.tenant, detail=a.detail)
        for a in monitor.alerting.alerts.firing.values()
    ]
