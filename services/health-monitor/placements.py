"""The leading monitor's part in where endpoints are delivered from (:mod:`hookline.shared.broker.placement`):
an endpoint is isolated before its breaker opens, taken back to its lane once the reason has gone and
its queue has stayed empty, and its queue of its own removed once nothing can reach it any more.

Removing a queue that may still receive (reference: control-plane-techniques.md §7): quorum queues have
no ``if-empty`` delete, and a queue's messages go with it. So, in this order, each step only once the
one before holds for every live dispatcher:

1. the endpoint is placed back in its lane (a record every replica applies: none hands it anything more),
   its direct route switched off first if it had one (direct.py);
2. every live dispatcher has applied that record (heartbeats carry the change-log offset applied);
3. the queue is unbound from the delay exchange: a retry or deferral still addressed to it now comes back
   unroutable and is forwarded to the lane (:mod:`hookline.shared.contracts.addressing`);
4. it has stayed empty, with nothing of its endpoint unacked at any dispatcher, for the grace period;
5. it is deleted, and a placement record says so (nobody consumes or counts it from then on).

An endpoint isolated again meanwhile (its queue declared and bound again by whoever isolates it) stops
this at whatever step it had reached. A *held* endpoint (isolated past the bound, in a shared holding
lane) has no queue to remove: it goes back to its lane once the reason has gone, it has been held for
the grace period and no live dispatcher holds a message of it; what is left of it in the holding lane
or the delay queues is forwarded to its lane when it comes up. One whose reason stands is given a queue
of its own once the bound has room again (the holding lane shares its head of line with the other held
endpoints); what it left in the holding lane is forwarded to that queue.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import structlog

from hookline.health_monitor.direct import Direct
from hookline.health_monitor.health import Health
from hookline.shared.broker import placement, topology
from hookline.shared.broker.amqp import BROKER_ERRORS, CALL_TIMEOUT_S, Broker
from hookline.shared.broker.isolation import Isolation
from hookline.shared.contracts.control import BreakerState
from hookline.shared.contracts.models import StoredEndpoint
from hookline.shared.state.registry import ChangeLog

log = structlog.get_logger(__name__)

#: Held endpoints given a queue of their own per sweep once the bound has room (each a declare and a
#: change-log write): a thousand held at once take their turns instead of stalling the sweep.
PROMOTIONS_PER_SWEEP = 10

#: Dynamic reasons that end by themselves once the queue has drained.
_DRAINED_REASONS = {placement.Reason.BACKLOGGED.value, placement.Reason.REPLAY.value}


@dataclass
class _Leaving:
    """An endpoint whose queue of its own is on its way out."""

    inline_at_offset: int  # the change-log offset (applied here) by which it was back in its lane
    unbound: bool = False
    empty_since_s: float | None = None


@dataclass
class Placements:
    broker: Broker
    change_log: ChangeLog
    isolation: Isolation
    direct: Direct
    health: Health
    slow_p95_ms: float
    grace_s: float
    timeout_s: float
    _leaving: dict[str, _Leaving] = field(default_factory=dict)
    _empty_since_s: dict[str, float] = field(default_factory=dict)

    async def isolate_for_breaker(self, endpoint_id: str) -> None:
        """Before a breaker opens: the endpoint's queue of its own, where its events wait (none waits in
        its lane), unless it has one already; past the bound, a holding lane, from which its copies wait
        out the breaker in the delay queues."""
        endpoint = self.change_log.registry.get(endpoint_id)
        if endpoint is not None and await self.isolation.isolate(
            endpoint, placement.Reason.BREAKER_OPEN.value
        ):
            self._leaving.pop(endpoint_id, None)

    async def sweep(self, depths: dict[str, int | None], *, leader: bool) -> None:
        """``depths``: the ready messages of each endpoint's queue of its own (None: it is missing)."""
        registry = self.change_log.registry
        now_s = time.monotonic()
        for endpoint_id in set(self._empty_since_s) - set(depths):
            del self._empty_since_s[endpoint_id]
        for endpoint_id, depth in depths.items():
            if depth == 0 and not self._unacked_somewhere(endpoint_id):
                self._empty_since_s.setdefault(endpoint_id, now_s)
            else:
                self._empty_since_s.pop(endpoint_id, None)
        for endpoint_id in set(self._leaving) - set(depths):
            del self._leaving[endpoint_id]
        if not leader:
            return
        for endpoint in registry.placements.with_queues():
            if not registry.placements.has_queue(endpoint.id) or endpoint.id not in depths:
                continue
            empty_for_s = now_s - self._empty_since_s.get(endpoint.id, now_s)
            if registry.placements.isolated(endpoint):
                self._leaving.pop(endpoint.id, None)
                if self._back_to_lane(endpoint, empty_for_s):
                    await self._place_inline(endpoint)
                continue
            await self._leave(endpoint, depths[endpoint.id], empty_for_s)
        await self._sweep_held()

    async def _sweep_held(self) -> None:
        """Held endpoints back to their lane once the reason has gone, or given a queue of their own
        once the bound has room while it stands."""
        now = datetime.now(UTC)
        promoted = 0
        for endpoint in self.change_log.registry.placements.held_endpoints():
            current = self.change_log.registry.placements.placement(endpoint.id)
            assert current is not None
            held_for_s = (now - current.at).total_seconds()
            if not self._unacked_somewhere(endpoint.id) and self._back_to_lane(endpoint, held_for_s):
                await self._place_inline(endpoint)
            elif promoted < PROMOTIONS_PER_SWEEP and await self.isolation.promote(endpoint):
                promoted += 1

    def _unacked_somewhere(self, endpoint_id: str) -> bool:
        """Whether a live dispatcher holds messages of the endpoint unacked (its last heartbeat says so)."""
        now_s = time.time()
        live = set(self.health.live_dispatchers(now_s))
        return any(beat.unacked.get(endpoint_id) for d, beat in self.health.dispatchers.items() if d in live)

    def _back_to_lane(self, endpoint: StoredEndpoint, empty_for_s: float) -> bool:
        """Whether an endpoint isolated at run time may go back to its lane (its own definition isolating
        it, it stays). ``empty_for_s``: how long its queue of its own has been empty (held: how long it
        has been held)."""
        current = self.change_log.registry.placements.placement(endpoint.id)
        if placement.structural(endpoint) is not None or current is None or not current.isolated:
            return False
        if empty_for_s < self.grace_s:
            return False
        health = self.health.endpoints.get(endpoint.id)
        if health is not None and health.breaker.state is not BreakerState.CLOSED:
            return False  # whatever isolated it, its events wait while its breaker is not closed
        if current.reason in _DRAINED_REASONS or current.reason == placement.Reason.BREAKER_OPEN.value:
            return True
        if current.reason == placement.Reason.SLOW.value:
            p95_ms = health.p95_recent_ms(time.time()) if health is not None else None
            return p95_ms is None or p95_ms < self.slow_p95_ms
        return True

    async def _place_inline(self, endpoint: StoredEndpoint) -> None:
        current = self.change_log.registry.placements.placement(endpoint.id)
        reason = current.reason if current else ""
        try:
            # Routed directly, its lane is bound for it again first; meanwhile the direct routes wait,
            # so that none switches it on again before it is back in its lane.
            async with self.direct.lock:
                await self.change_log.sync(timeout_s=self.timeout_s)
                route = self.change_log.registry.placements.direct(endpoint)
                if route is not None and not await self.direct.switch_off(endpoint, route):
                    return
                await self.change_log.place(
                    endpoint.id, isolated=False, reason=reason, timeout_s=self.timeout_s
                )
        except BROKER_ERRORS as exc:
            log.warning("placement_failed", endpoint_id=endpoint.id, error=type(exc).__name__)
            return
        log.info("endpoint_back_in_lane", endpoint_id=endpoint.id, was=reason)

    async def _leave(self, endpoint: StoredEndpoint, depth: int | None, empty_for_s: float) -> None:
        """Steps 2 to 5 of the module's docstring, one poll at a time."""
        if depth is None:
            # Not there (removed by hand, or never declared for this generation): nothing to wait for.
            await self._removed(endpoint)
            return
        leaving = self._leaving.get(endpoint.id)
        if leaving is None:
            offset = self.change_log.applied_offset
            if offset is None:
                return
            leaving = self._leaving[endpoint.id] = _Leaving(inline_at_offset=offset)
        if self._lagging(leaving.inline_at_offset):
            return
        name = topology.own_queue(endpoint)
        try:
            if not leaving.unbound:
                async with self.broker.channel() as channel:
                    queue = await channel.get_queue(name, ensure=False)
                    await queue.unbind(
                        topology.DELAY_DELIVERY, routing_key=topology.delay_delivery_binding(name)
                    )
                leaving.unbound = True
                leaving.empty_since_s = None
                self._empty_since_s.pop(endpoint.id, None)  # the grace counts from the unbinding
                return
            if depth > 0 or empty_for_s < self.grace_s:
                return
            async with self.broker.channel() as channel:
                await channel.queue_delete(name, timeout=CALL_TIMEOUT_S)
        except BROKER_ERRORS as exc:
            log.warning("queue_removal_failed", endpoint_id=endpoint.id, queue=name, error=type(exc).__name__)
            return
        log.info("queue_removed", queue=name, endpoint_id=endpoint.id)
        await self._removed(endpoint)

    async def _removed(self, endpoint: StoredEndpoint) -> None:
        """The placement that says its queue of its own is gone (nobody consumes or counts it)."""
        try:
            await self.change_log.place(
                endpoint.id, isolated=False, reason="", queue_removed=True, timeout_s=self.timeout_s
            )
        except BROKER_ERRORS as exc:
            log.warning("placement_failed", endpoint_id=endpoint.id, error=type(exc).__name__)
            return
        self._leaving.pop(endpoint.id, None)

    def _lagging(self, offset: int) -> bool:
        """Whether a live dispatcher has not applied the change log up to ``offset`` yet."""
        now_s = time.time()
        live = set(self.health.live_dispatchers(now_s))
        return any(
            beat.applied_offset is not None and beat.applied_offset < offset
            for d, beat in self.health.dispatchers.items()
            if d in live and not beat.stopping
        )
