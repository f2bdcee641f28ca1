"""Giving an endpoint a queue of its own at run time (:mod:`hookline.shared.broker.placement`): a dispatcher
for one that is slow or backlogged, the leading monitor before its breaker opens, the ingest before it
replays or redrives many events to it.

Its queue is declared first, then its placement written to the change log, conditionally: every
replica applies the same record, hands the endpoint's copies to that queue from then on, and consumes
it. One isolation at a time per endpoint in a process; another process doing the same at once loses the
conditional write and finds the endpoint isolated. The number of queues of their own is bounded
(``HOOKLINE_MAX_ENDPOINT_QUEUES``): past it, the endpoint is *held* — isolated in one of the shared
holding lanes instead (:func:`~hookline.shared.broker.topology.holding_of`, declared with the core topology),
so that a thousand endpoints failing at once cost four queues and never a healthy lane's time. The bound
holds across processes too: each placement carries its writer's bound, and one applied where the change
log already counts that many queues of their own holds the endpoint instead (every replica folds the log
in the same order, so all agree); its writer then removes the queue it had declared, empty and unused.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import structlog

from hookline.shared.broker import topology
from hookline.shared.broker.amqp import BROKER_ERRORS, CALL_TIMEOUT_S, Broker
from hookline.shared.contracts.models import Placement, StoredEndpoint
from hookline.shared.state.registry import ChangeLog

log = structlog.get_logger(__name__)

# Queues of their own a process declares at once. A hundred endpoints turning slow together (one
# receiver host saturated) would otherwise start a hundred quorum queues within 0.3 s, every replica
# then attaching a consumer to each: the broker and the replicas' loops busy enough that an event to
# the hundred healthy endpoints beside them arrived 160-235 ms late (p99 258 ms). Two at a time spread
# them over about a second, as the leading monitor's isolations one by one already did (p99 81 ms).
DECLARING_AT_ONCE = 2


class Isolation:
    def __init__(self, broker: Broker, change_log: ChangeLog, *, max_queues: int, timeout_s: float) -> None:
        self._broker = broker
        self._change_log = change_log
        self._max_queues = max_queues
        self._timeout_s = timeout_s
        self._isolating: dict[str, asyncio.Lock] = {}
        # Tasks holding or waiting for each lock: a lock dropped while one still waits (released, its
        # waiter not yet woken) would let the next caller take a new one beside it.
        self._users: Counter[str] = Counter()
        self._declaring = asyncio.Semaphore(DECLARING_AT_ONCE)

    async def isolate(self, endpoint: StoredEndpoint, reason: str) -> bool:
        """Whether the endpoint is isolated now (it may have been already): in a queue of its own, or
        held in a holding lane past the bound."""
        if endpoint.polling:
            return False  # nothing is delivered to it, so nothing of it can hold a lane
        registry = self._change_log.registry
        if registry.placements.isolated(endpoint):
            return True
        await self._place(endpoint, reason, promoting=False)
        now = registry.get(endpoint.id)
        return now is not None and registry.placements.isolated(now)

    async def promote(self, endpoint: StoredEndpoint) -> bool:
        """A held endpoint given the queue of its own it was refused, the bound having room again (the
        leading monitor asks while what held it stands: a holding lane shares its head of line with the
        other held endpoints); whether it has one now. What it left in the holding lane is forwarded to
        its queue as it comes up."""
        registry = self._change_log.registry
        current = registry.placements.placement(endpoint.id)
        if current is None or not registry.placements.held(endpoint) or self._past_bound(endpoint):
            return False
        await self._place(endpoint, current.reason, promoting=True)
        return registry.placements.has_queue(endpoint.id)

    def _past_bound(self, endpoint: StoredEndpoint) -> bool:
        """Whether a queue of its own for the endpoint would pass the bound. Isolations under way here
        count too: a thousand endpoints turning slow at once (a receiver host saturated) would otherwise
        all pass the check before the first is placed, and declare a thousand queues at once."""
        registry = self._change_log.registry
        under_way = 0 if endpoint.id in self._isolating else len(self._isolating)
        # A queue of its own it still has (on its way out) is used again: it counts already.
        return (
            registry.placements.queued_count + under_way >= self._max_queues
            and not registry.placements.has_queue(endpoint.id)
        )

    async def _place(self, endpoint: StoredEndpoint, reason: str, *, promoting: bool) -> None:
        registry = self._change_log.registry
        held = self._past_bound(endpoint)
        lock = self._isolating.setdefault(endpoint.id, asyncio.Lock())
        self._users[endpoint.id] += 1
        try:
            # Held, it declares nothing: a thousand held at once cost a write each.
            async with lock, contextlib.nullcontext() if held else self._declaring:
                current = registry.get(endpoint.id)
                if current is None:
                    return
                if (
                    (registry.placements.held(current) and not held)
                    if promoting
                    else not registry.placements.isolated(current)
                ):
                    placed = await self._write(current, reason, held=held)
                    if placed is not None:  # this process's write, not another's that came first
                        log.warning(
                            "endpoint_isolated", endpoint_id=endpoint.id, reason=reason,
                            held=not registry.placements.has_queue(endpoint.id), promoted=promoting,
                        )  # fmt: skip
                # else another task here, or another replica, placed it meanwhile
        except BROKER_ERRORS as exc:  # the write timed out, or the broker refused
            log.warning("isolation_failed", endpoint_id=endpoint.id, reason=reason, error=type(exc).__name__)
        finally:
            self._users[endpoint.id] -= 1
            if not self._users[endpoint.id]:
                del self._users[endpoint.id], self._isolating[endpoint.id]

    async def _write(self, current: StoredEndpoint, reason: str, *, held: bool) -> Placement | None:
        """Its queue declared (unless held), then its placement written; the placement as written, or
        None when another writer's came first."""
        registry = self._change_log.registry
        decided_on = registry.placements.placement(current.id)
        try:
            if not held:
                await self.ensure_queue(current)
            if registry.placements.placement(current.id) is not decided_on and (
                held or not registry.placements.held(current)
            ):
                # Placed meanwhile (another replica gave it a queue, the monitor took it back): that one
                # stands. Written on top of it, this would be a second isolation decided on the state
                # before (two replicas each logged one for the same endpoint, 0.2 s apart). Placed held
                # meanwhile, it takes the queue declared for it, as a promotion would.
                return None
            return await self._change_log.place(
                current.id, isolated=True, reason=reason, held=held, timeout_s=self._timeout_s,
                bound=None if held else self._max_queues,
            )  # fmt: skip
        finally:
            if not held and not registry.placements.has_queue(current.id):
                # Held after all (other processes' isolations reached the bound first, or another's
                # placement of it came first), or not placed (the write timed out, the broker refused):
                # the queue declared for it is empty, and no replica hands it anything. Left, it would
                # hold broker file handles the bound does not count (at 100,000 endpoints under load: 219
                # such queues, the broker's handles full).
                await self._remove_unused(current)

    async def _remove_unused(self, endpoint: StoredEndpoint) -> None:
        name = topology.own_queue(endpoint)
        try:
            async with self._broker.channel() as channel:
                await channel.queue_delete(name, timeout=CALL_TIMEOUT_S)
        except BROKER_ERRORS as exc:  # left declared, empty: it costs its file handles, nothing else
            log.warning(
                "unused_queue_not_removed", endpoint_id=endpoint.id, queue=name, error=type(exc).__name__
            )
            return
        log.info("unused_queue_removed", endpoint_id=endpoint.id, queue=name)

    async def ensure_queue(self, endpoint: StoredEndpoint) -> None:
        """Its queue of its own, declared (idempotent), bound for what is addressed to it."""
        async with self._broker.channel() as channel:
            await topology.declare_own_queue(channel, endpoint)
