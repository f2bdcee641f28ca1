"""Tenant patterns no endpoint needs any more, unbound from their lane by the leading monitor.

The ingest binds a tenant's lane for a pattern when an endpoint first needs it (an idempotent bind,
after every dispatcher knows the endpoint: endpoints.py); it never unbinds, since another replica may be
creating an endpoint with the same pattern at that moment. Here, a pattern none of its tenant's
endpoints (nor one being deleted, whose lane has not passed the fence yet) names any more is noted; once
it has stayed unneeded for the grace period, the monitor reads the change log up to now, unbinds it if
it is still unneeded, then reads the change log again and binds it back if an endpoint named it
meanwhile. What is left is a window of milliseconds, between the read and the unbind, in which a
creation of the same pattern on an ingest would have its binding removed and put back: events published
in between would reach that endpoint's tenant's other patterns but not it.

A binding nobody needs costs the broker a little memory (0.68 KiB) and each matching event a write to
the lane that the fan-out then drops: worth removing, not urgent. A pattern an endpoint's queue of its
own is bound to ``events`` for (a direct route: direct.py) is not needed on the lane, and is unbound
here too, the direct route bound first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import structlog
from aio_pika.abc import AbstractChannel

from hookline.shared.broker import topology
from hookline.shared.broker.amqp import BROKER_ERRORS, Broker
from hookline.shared.contracts.models import StoredEndpoint
from hookline.shared.state.registry import ChangeLog, EndpointRegistry

log = structlog.get_logger(__name__)

#: How far back a start looks for deleted endpoints whose bindings may be unneeded.
SEED_LOOKBACK = timedelta(days=1)

_Key = tuple[str, str]  # (tenant, pattern)


@dataclass
class Bindings:
    broker: Broker
    change_log: ChangeLog
    grace_s: float
    timeout_s: float
    _unneeded_since_s: dict[_Key, float] = field(default_factory=dict)

    def on_change(self, before: StoredEndpoint | None, after: StoredEndpoint | None) -> None:
        """A registry listener: the patterns an endpoint no longer names (changed, or deleted) may be
        unneeded by its tenant now; one it names again is needed."""
        registry = self.change_log.registry
        for endpoint in (before, after):
            if endpoint is None:
                continue
            still = registry.subscriptions.patterns_needed(endpoint.tenant)
            now_s = time.monotonic()
            for pattern in endpoint.event_types:
                key = (endpoint.tenant, pattern)
                if pattern in still:
                    self._unneeded_since_s.pop(key, None)
                else:
                    self._unneeded_since_s.setdefault(key, now_s)

    def seed(self) -> None:
        """At start, after the change log was read (this tracker was not listening then): the patterns
        of the endpoints deleted in the last day, the unneeded among them to be unbound. (A pattern
        dropped by an edit before this start, or by a deletion before that day, which a monitor running
        then would have unbound, is not known here: its binding stays, harmless.)"""
        since = datetime.now(UTC) - SEED_LOOKBACK
        for gone in self.change_log.registry.deletions.deleted_since(since):
            self.on_change(gone, None)

    @property
    def unneeded(self) -> set[_Key]:
        """The (tenant, pattern) pairs noted as unneeded, not unbound yet."""
        return set(self._unneeded_since_s)

    async def sweep(self, *, leader: bool) -> None:
        if not leader or not self._unneeded_since_s:
            return
        now_s = time.monotonic()
        due = [key for key, since_s in self._unneeded_since_s.items() if now_s - since_s >= self.grace_s]
        if not due:
            return
        try:
            await self.unbind(due)
        except BROKER_ERRORS as exc:
            log.warning("binding_sweep_failed", error=type(exc).__name__)
            return
        for key in due:
            self._unneeded_since_s.pop(key, None)

    async def unbind(self, keys: list[_Key]) -> None:
        """Of ``keys``, the patterns their tenant's lane need not be bound for (the change log read up to
        now), unbound; any named again meanwhile bound back. A pattern an endpoint's queue of its own is
        recorded as bound to ``events`` for is bound there first (idempotent: a monitor that recorded a
        direct route may have stopped before it bound it), so that no event of it goes nowhere."""
        await self.change_log.sync(timeout_s=self.timeout_s)
        registry = self.change_log.registry
        gone = [(t, p) for t, p in keys if p not in registry.subscriptions.patterns_needed(t)]
        if not gone:
            return
        async with self.broker.channel() as channel:
            await bind_direct_routes(channel, registry, {tenant for tenant, _ in gone})
            for tenant, pattern in gone:
                await topology.unbind_pattern(channel, tenant, pattern)
        await self.change_log.sync(timeout_s=self.timeout_s)
        # Named again meanwhile (an ingest was creating one): bound back at once.
        again = [(t, p) for t, p in gone if p in registry.subscriptions.patterns_needed(t)]
        async with self.broker.channel() as channel:
            for tenant, pattern in again:
                await topology.bind_patterns(channel, tenant, [pattern])
        for tenant, pattern in gone:
            log.info("pattern_unbound", tenant=tenant, pattern=pattern, lane=topology.lane_of(tenant))
        for tenant, pattern in again:
            log.warning("pattern_bound_again", tenant=tenant, pattern=pattern, lane=topology.lane_of(tenant))


async def bind_direct_routes(channel: AbstractChannel, registry: EndpointRegistry, tenants: set[str]) -> None:
    """Every direct route the registry records for an endpoint of ``tenants``, bound (idempotent)."""
    for endpoint_id, route in registry.placements.directly_routed():
        endpoint = registry.get(endpoint_id)
        if endpoint is not None and endpoint.tenant in tenants:
            await topology.bind_direct(channel, route.queue, endpoint.tenant, route.patterns)
