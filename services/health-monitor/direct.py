"""Direct routes: an isolated endpoint's queue of its own bound to ``events`` for its patterns, its lane
no longer bound for them, switched by the leading monitor.

Isolated, an endpoint's events still pass through its tenant's lane: each is written to the lane, given
to a dispatcher, handed on to the queue of its own with a confirm, and acked there — three queue writes
and two deliveries where one of each would do. During a burst to one endpoint that is the broker's
work, and on a small machine the other lanes' latency. With a direct route the broker puts the events
straight into the endpoint's queue (``docs/decisions.md``, "Direct routes").

An endpoint is routed directly while it is isolated with a queue of its own and
:func:`~hookline.shared.broker.placement.direct_patterns` allows it: not ordered, and no other endpoint of its
tenant names an overlapping pattern. Each switch keeps every event on at least one way in, in this
order (a monitor stopped half-way leaves a state the next leader finishes or undoes):

- **on**: the route is recorded in the change log (every replica's view of what the lane needs leaves
  those patterns out), the queue bound to ``events``, then the lane unbound for the patterns no endpoint
  needs there any more (:meth:`Bindings.unbind`, which binds every recorded route first);
- **off** (an overlapping endpoint appeared, the endpoint's patterns or queue changed, it is to go back
  to its lane): the lane bound for the endpoint's patterns, the queue unbound from ``events``, then the
  route's record removed.

Between the two bindings of a switch an event is routed both ways: the endpoint may get it twice (at
least once, as a redelivery would; a handful of events during a burst). Nothing is dropped on either
side: the lane hands on every copy it has of an isolated endpoint, and the queue delivers every copy
that reaches it (one for an event type the endpoint no longer subscribes to is acked unsent, as the lane
would not have fanned it out to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from hookline.health_monitor.bindings import Bindings
from hookline.shared.broker import placement, topology
from hookline.shared.broker.amqp import BROKER_ERRORS, Broker
from hookline.shared.contracts.models import DirectRoute, StoredEndpoint
from hookline.shared.runtime.supervision import Loop
from hookline.shared.state.registry import ChangeLog

log = structlog.get_logger(__name__)

#: How long the leader lets changes that come together gather before one pass over them (a hundred
#: endpoints isolated at once: one unbinding of their lanes). Otherwise it looks at once: what a burst
#: sends its lane before the switch, the lane's neighbours wait for (polls every 0.25 s added 0.13 s on
#: average).
GATHER_S = 0.02
#: Passes stay this far apart: a registration storm changes the registry a thousand times a second.
PASS_GAP_S = 0.25
#: How often it looks at the latest, changed or not (a route lost with its binding is bound again).
RECHECK_S = 5.0
#: How often the loop says it is alive while nothing changes.
BEAT_S = 0.25


@dataclass
class Direct:
    broker: Broker
    change_log: ChangeLog
    bindings: Bindings
    leading: Callable[[], bool]
    timeout_s: float
    # Held while routes are switched, and by whoever takes an endpoint back to its lane (placements.py).
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _due: asyncio.Event = field(default_factory=asyncio.Event)
    # Queues whose recorded route this leader has bound since it leads (a queue declared again after a
    # loss, or a route recorded by a leader that stopped before it bound it, is bound again).
    _ensured: set[str] = field(default_factory=set)
    _released: set[str] = field(default_factory=set)  # deleted endpoints' routes, unbound since it leads

    def on_change(self, before: StoredEndpoint | None, after: StoredEndpoint | None) -> None:
        """A registry listener: an endpoint or placement changed, so may what is routed directly."""
        del before, after
        self._due.set()

    def forget_bound(self) -> None:
        """Bind every recorded route again at the next pass (leadership taken, queues declared again)."""
        self._ensured.clear()
        self._released.clear()
        self._due.set()

    async def run(self, loop: Loop) -> None:
        loop.mark_up()
        looked_at_s = time.monotonic()
        while True:
            loop.beat()
            if self.leading() and (self._due.is_set() or time.monotonic() - looked_at_s >= RECHECK_S):
                self._due.clear()
                looked_at_s = time.monotonic()
                try:
                    async with self.lock:
                        await self.reconcile()
                except BROKER_ERRORS as exc:  # looked at again in RECHECK_S, not at once
                    log.warning("direct_routes_failed", error=type(exc).__name__)
            elif not self.leading():
                # A leader to be starts with every route looked at (forget_bound): nothing is due here.
                self._due.clear()
                self._ensured.clear()
                self._released.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(BEAT_S):
                    await self._due.wait()
            if self._due.is_set():
                await asyncio.sleep(max(GATHER_S, looked_at_s + PASS_GAP_S - time.monotonic()))

    async def reconcile(self) -> None:
        """Every direct route as :func:`placement.direct_patterns` wants it: switched off where it no
        longer fits, on where it is wanted, bound where this leader has not bound it yet."""
        registry = self.change_log.registry
        for endpoint_id, route in registry.placements.directly_routed():
            endpoint = registry.get(endpoint_id)
            if endpoint is None:
                await self._release(endpoint_id, route)
                continue
            if route.queue == topology.own_queue(endpoint) and route.patterns == self.wanted(endpoint):
                if route.queue not in self._ensured:
                    async with self.broker.channel() as channel:
                        await topology.bind_direct(channel, route.queue, endpoint.tenant, route.patterns)
                    self._ensured.add(route.queue)
                continue
            await self.switch_off(endpoint, route)
        switched: list[tuple[StoredEndpoint, tuple[str, ...]]] = []
        for endpoint in registry.placements.with_queues():
            patterns = self.wanted(endpoint) if registry.placements.direct(endpoint) is None else ()
            if patterns and await self._bind(endpoint, patterns):
                switched.append((endpoint, patterns))
        if switched:
            # One read of the change log (two markers in it) for every route switched on in this pass:
            # a hundred endpoints isolated at once would otherwise write two hundred.
            await self.bindings.unbind(
                [(e.tenant, pattern) for e, patterns in switched for pattern in patterns]
            )
        for endpoint, patterns in switched:
            log.info(
                "endpoint_routed_directly", endpoint_id=endpoint.id, queue=topology.own_queue(endpoint),
                patterns=list(patterns),
            )  # fmt: skip

    async def _release(self, endpoint_id: str, route: DirectRoute) -> None:
        """A deleted endpoint's route unbound (the ingest does so as it deletes it; here once more, for
        an ingest stopped half-way or a switch that raced the deletion), once per leadership: its queue
        is drained into dead letters and removed, and nothing published from now on is to reach it."""
        if route.queue in self._released:
            return
        gone = self.change_log.registry.deletions.last_known(endpoint_id)
        if gone is not None:
            async with self.broker.channel() as channel:
                await topology.unbind_direct(channel, route.queue, gone.tenant, route.patterns)
        self._released.add(route.queue)

    def wanted(self, endpoint: StoredEndpoint) -> tuple[str, ...]:
        """The patterns the endpoint's queue of its own is to be bound to ``events`` for (none: its lane's)."""
        registry = self.change_log.registry
        if (
            not registry.placements.isolated(endpoint)
            or registry.placements.held(endpoint)
            or not registry.placements.has_queue(endpoint.id)
        ):
            return ()
        others = [
            *registry.rows.of_tenant(endpoint.tenant),
            *registry.deletions.deleting_of_tenant(endpoint.tenant),
        ]
        return placement.direct_patterns(endpoint, others=others)

    async def _bind(self, endpoint: StoredEndpoint, patterns: tuple[str, ...]) -> bool:
        """The first two steps of a switch on: the route recorded, the queue bound; whether they were
        taken (the lane is unbound for every route switched on in the pass at once)."""
        queue = topology.own_queue(endpoint)
        route = DirectRoute(queue=queue, patterns=patterns)
        if await self.change_log.route(endpoint.id, route, timeout_s=self.timeout_s) is None:
            self._due.set()  # placed otherwise meanwhile: looked at again
            return False
        async with self.broker.channel() as channel:
            await topology.bind_direct(channel, queue, endpoint.tenant, patterns)
        if self.change_log.registry.get(endpoint.id) is None:
            self._due.set()  # deleted meanwhile (its ingest unbound before this bound): released next
            return False
        self._ensured.add(queue)
        return True

    async def switch_off(self, endpoint: StoredEndpoint, route: DirectRoute) -> bool:
        """The endpoint's lane bound for its patterns again, its queue unbound from ``events``, the route's
        record removed; whether the record is gone (another writer may have changed the placement)."""
        async with self.broker.channel() as channel:
            await topology.bind_patterns(channel, endpoint.tenant, endpoint.event_types)
            await topology.unbind_direct(channel, route.queue, endpoint.tenant, route.patterns)
        self._ensured.discard(route.queue)
        if await self.change_log.route(endpoint.id, None, timeout_s=self.timeout_s) is None:
            self._due.set()
            return False
        log.info("endpoint_routed_through_lane", endpoint_id=endpoint.id, queue=route.queue)
        return True
