"""Per-tenant quotas, set by the admin (``PUT /v1/tenants/{tenant}/quota``) and kept in the change log.

- **endpoints**: how many endpoints the tenant may have; checked at registration.
- **events per second**: a token bucket per tenant in each ingest replica (``burst`` events at once,
  refilled at ``events_per_s``); with N replicas behind a balancer a tenant gets up to N times the rate.
- **bytes per day**: event bytes per UTC day, counted in the delivery log from the event log, so across
  every replica and the AMQP upstreams alike (a second or so behind the publishes).

Over a quota: 429 ``quota_exceeded`` with ``Retry-After`` (when a token is back, the next UTC day, or a
minute for the endpoint count, which only a deletion or the admin changes). Quotas apply to the HTTP
API; an upstream publishing over AMQP is limited by its broker permissions instead (README).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from hookline.ingest import audit
from hookline.ingest.audit import Trail
from hookline.ingest.auth import Caller
from hookline.ingest.deliverylog import DAY_S, DeliveryLog
from hookline.ingest.state import Changes, Settings, ingest_state
from hookline.shared.contracts.models import Model, Tenant, TenantQuota
from hookline.shared.runtime.api import ApiError
from hookline.shared.state.registry import EndpointRegistry
from hookline.shared.state.tenants import NO_QUOTA, Tenants

#: What Retry-After says when only a deletion (or the admin) makes room.
ENDPOINTS_RETRY_AFTER_S = 60
#: Bytes this replica admitted are counted on top of the delivery log's tally until the log has read past
#: their acceptance time (it follows the event log about a second behind: a burst of requests must not all
#: pass on one reading), and for this long at most (a publish that failed after its check).
PENDING_WINDOW_S = 60.0


@dataclass(frozen=True)
class Bucket:
    tokens: float
    at_s: float


def take(bucket: Bucket | None, *, rate_per_s: float, burst: int, now_s: float) -> tuple[Bucket, float]:
    """Take one token: the bucket after, and 0.0 when admitted, else the seconds until one is there (the
    bucket then refilled to now). A full bucket holds ``burst`` tokens; a new one starts full."""
    held = burst if bucket is None else min(burst, bucket.tokens + (now_s - bucket.at_s) * rate_per_s)
    if held >= 1:
        return Bucket(held - 1, now_s), 0.0
    return Bucket(held, now_s), (1 - held) / rate_per_s


def over_quota(message: str, retry_after_s: float) -> ApiError:
    return ApiError(
        429, "quota_exceeded", message, headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    )


class Usage(Model):
    endpoints: int
    events_today: int
    bytes_today: int


class QuotaView(Model):
    tenant: str
    quota: TenantQuota
    usage: Usage


class Quotas:
    def __init__(self, tenants: Tenants, registry: EndpointRegistry, delivery_log: DeliveryLog) -> None:
        self._tenants = tenants
        self._registry = registry
        self._delivery_log = delivery_log
        self._buckets: dict[str, Bucket] = {}
        self._admitted: dict[str, deque[tuple[float, int]]] = {}  # tenant -> (when, bytes), recent

    def _endpoint_count(self, tenant: str) -> int:
        return self._registry.rows.count_of_tenant(tenant)

    def check_endpoints(self, tenant: str) -> None:
        limit = self._tenants.quota(tenant).max_endpoints
        if limit is not None and self._endpoint_count(tenant) >= limit:
            raise over_quota(
                f"tenant {tenant!r} has {limit} endpoints, its quota (max_endpoints)", ENDPOINTS_RETRY_AFTER_S
            )

    async def check_event(self, tenant: str, *, size_bytes: Callable[[], int], now_s: float) -> None:
        """Admit one event of ``size_bytes()`` bytes (measured only when a bytes quota is set), or raise
        429. A batch is admitted event by event: each item gets its own answer."""
        quota = self._tenants.quota(tenant)
        if quota == NO_QUOTA:
            return
        day_start_s = now_s - now_s % DAY_S
        # Taken before the read: every event applied by then is in what the read counts (it writes the
        # view first); one applied while the read runs may be counted twice below, never missed.
        counted_until_s = self._delivery_log.latest_accepted_s
        used = 0
        if quota.bytes_per_day is not None:
            _, used = await self._delivery_log.day_of(tenant, day_start_s=day_start_s)
        # From here to the end no await: concurrent requests (a batch's items) see each other's bytes.
        recent = self._admitted.setdefault(tenant, deque())
        while recent and recent[0][0] < now_s - PENDING_WINDOW_S:
            recent.popleft()
        size = size_bytes() if quota.bytes_per_day is not None else 0
        if quota.bytes_per_day is not None:
            pending = sum(admitted for at_s, admitted in recent if at_s > counted_until_s)
            if used + pending + size > quota.bytes_per_day:
                raise over_quota(
                    f"tenant {tenant!r} has published {used + pending} of its {quota.bytes_per_day} "
                    "bytes today (bytes_per_day, UTC)",
                    day_start_s + DAY_S - now_s,
                )
        if quota.events_per_s is not None:
            burst = quota.burst or max(1, math.ceil(quota.events_per_s))
            bucket, wait_s = take(
                self._buckets.get(tenant), rate_per_s=quota.events_per_s, burst=burst, now_s=now_s
            )
            self._buckets[tenant] = bucket
            if wait_s > 0:
                raise over_quota(
                    f"tenant {tenant!r} may publish {quota.events_per_s:g} events/s (burst {burst})", wait_s
                )
        recent.append((now_s, size))

    async def view(self, tenant: str, now_s: float) -> QuotaView:
        day = await self._delivery_log.day_of(tenant, day_start_s=now_s - now_s % DAY_S)
        return QuotaView(
            tenant=tenant,
            quota=self._tenants.quota(tenant),
            usage=Usage(endpoints=self._endpoint_count(tenant), events_today=day[0], bytes_today=day[1]),
        )


router = APIRouter(prefix="/v1/tenants", tags=["tenants"])


async def _quotas(request: Request) -> Quotas:
    return ingest_state(request).quotas


QuotasOf = Annotated[Quotas, Depends(_quotas)]


@router.get("/{tenant}/quota", response_model=QuotaView)
async def get_quota(tenant: Tenant, quotas: QuotasOf, caller: Caller) -> QuotaView:
    caller.require(tenant)
    return await quotas.view(tenant, datetime.now(UTC).timestamp())


@router.put("/{tenant}/quota", response_model=QuotaView)
async def set_quota(
    tenant: Tenant,
    quota: TenantQuota,
    quotas: QuotasOf,
    change_log: Changes,
    settings: Settings,
    trail: Trail,
    caller: Caller,
) -> QuotaView:
    caller.require_admin("set quotas")
    before = change_log.tenants.quota(tenant)
    await change_log.write_quota(tenant, quota, timeout_s=settings.registry_wait_s)
    await trail.record(
        caller, "tenant.quota_set", tenant=tenant, target=tenant, changes=audit.changes_between(before, quota)
    )
    return await quotas.view(tenant, datetime.now(UTC).timestamp())
