"""Consuming endpoints' queues of their own (:mod:`hookline.shared.broker.placement`), and only those:
- its current queue is consumed for delivery while the endpoint is active, verified and its breaker
  is closed (an open breaker leaves its messages waiting in the queue), with a prefetch that fits its
  standing (refit every few seconds);
- the queues it left behind (a queue move) are consumed to forward whatever is still in them, or comes
  back to them late, to its address;
- once it is deleted, all its queues are consumed to turn what is left into ``endpoint_gone`` dead
  letters, until the monitor removes them.
A current queue found missing (deleted by hand, lost with a node) is provisioned again, and said so.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from functools import partial

import structlog
from aio_pika.abc import AbstractChannel, AbstractQueue

from hookline.dispatcher import consumed, metrics
from hookline.dispatcher.admission import Standing
from hookline.dispatcher.changes import Changes
from hookline.dispatcher.consumed import Incoming
from hookline.dispatcher.handler import Handler, handle_safely
from hookline.dispatcher.handling import Handling
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import BROKER_ERRORS, CALL_TIMEOUT_S, QueueProbe
from hookline.shared.contracts.control import BreakerView
from hookline.shared.contracts.models import EndpointStatus, StoredEndpoint
from hookline.shared.runtime.supervision import Loop
from hookline.shared.state.registry import EndpointRegistry

log = structlog.get_logger(__name__)

#: How often consumers whose prefetch no longer fits their endpoint's standing are consumed again.
REFIT_EVERY_S = 5.0


class Mode(Enum):
    DELIVER = "deliver"
    FORWARD = "forward"  # a queue the endpoint left: into its current queue
    GONE = "gone"  # a deleted endpoint's queue: into the dead letters


@dataclass(frozen=True, slots=True)
class _Wanted:
    endpoint_id: str
    mode: Mode
    prefetch: int


@dataclass(frozen=True, slots=True)
class _Consumer:
    wanted: _Wanted
    tag: str
    channel: AbstractChannel


class _Active:
    """The consumers this replica holds, by queue name and by endpoint: a change to one endpoint looks
    only at that endpoint's (looking through all of them made attaching to 10,000 queues quadratic:
    about 100 s, three quarters of it in that scan; 31 s without)."""

    def __init__(self) -> None:
        self._by_queue: dict[str, _Consumer] = {}
        self._by_endpoint: defaultdict[str, set[str]] = defaultdict(set)

    def __len__(self) -> int:
        return len(self._by_queue)

    def __contains__(self, queue_name: str) -> bool:
        return queue_name in self._by_queue

    def items(self) -> list[tuple[str, _Consumer]]:
        return list(self._by_queue.items())

    def values(self) -> list[_Consumer]:
        return list(self._by_queue.values())

    def get(self, queue_name: str) -> _Consumer | None:
        return self._by_queue.get(queue_name)

    def of_endpoint(self, endpoint_id: str) -> list[tuple[str, _Consumer]]:
        return [(name, self._by_queue[name]) for name in self._by_endpoint.get(endpoint_id, ())]

    def add(self, queue_name: str, consumer: _Consumer) -> None:
        self._by_queue[queue_name] = consumer
        self._by_endpoint[consumer.wanted.endpoint_id].add(queue_name)

    def pop(self, queue_name: str) -> _Consumer:
        consumer = self._by_queue.pop(queue_name)
        names = self._by_endpoint[consumer.wanted.endpoint_id]
        names.discard(queue_name)
        if not names:
            del self._by_endpoint[consumer.wanted.endpoint_id]
        return consumer

    def clear(self) -> None:
        self._by_queue.clear()
        self._by_endpoint.clear()


class OwnQueues:
    def __init__(
        self,
        registry: EndpointRegistry,
        breakers: BreakerView,
        handler: Handler,
        handling: Handling,
        changes: Changes,
        queues: QueueProbe,
        channel_for: Callable[[int], Awaitable[AbstractChannel]],
        *,
        default_prefetch: int,
    ) -> None:
        self._registry = registry
        self._breakers = breakers
        self._handler = handler
        self._handling = handling
        self._changes = changes
        self._queues = queues  # declares: an error there closes its channel, not a consumer's
        self._channel_for = channel_for
        self._default_prefetch = default_prefetch
        self.active = _Active()
        self._missing_since_s: dict[str, float] = {}  # current queues found missing, not yet declared again

    async def reconcile(self, endpoint_id: str) -> None:
        """The endpoint's consumers as its record and breaker want them: those no longer wanted
        cancelled, those missing attached."""
        wanted = self._wanted(endpoint_id)
        for queue_name, consumer in self.active.of_endpoint(endpoint_id):
            if wanted.get(queue_name) != consumer.wanted:
                # Breaker open, endpoint paused or gone, its cap changed, or the queue was left behind.
                self.active.pop(queue_name)
                with contextlib.suppress(*BROKER_ERRORS):
                    await consumed.cancel(consumer.channel, consumer.tag, timeout_s=CALL_TIMEOUT_S)
        for queue_name, want in wanted.items():
            if queue_name not in self.active:
                await self._attach(queue_name, want)

    def _wanted(self, endpoint_id: str) -> dict[str, _Wanted]:
        endpoint = self._registry.get(endpoint_id)
        if self._changes.stopping:
            return {}
        if endpoint is None:
            gone = self._registry.deletions.last_known(endpoint_id)
            if gone is None:
                return {}
            return {name: _Wanted(endpoint_id, Mode.GONE, 1) for name in topology.endpoint_queues(gone)}
        wanted = {name: _Wanted(endpoint_id, Mode.FORWARD, 1) for name in endpoint.retired_queues}
        if (
            self._registry.placements.has_queue(endpoint_id)
            and endpoint.status is EndpointStatus.ACTIVE
            and endpoint.verified
            and self._breakers.state(endpoint_id) is None
        ):
            wanted[topology.own_queue(endpoint)] = _Wanted(
                endpoint_id, Mode.DELIVER, self._prefetch(endpoint)
            )
        return wanted

    def _prefetch(self, endpoint: StoredEndpoint) -> int:
        """Unacked deliveries this dispatcher may hold for the endpoint: for a capped endpoint (served by
        one dispatcher at a time) its ``max_in_flight``, no more than 10 s of its rate limit, and for a
        slow endpoint its part of the slow share (admission.py)."""
        prefetch = endpoint.max_in_flight or self._default_prefetch
        if endpoint.rate_limit_per_s is not None:
            prefetch = min(prefetch, max(1, math.ceil(endpoint.rate_limit_per_s * 10)))
        ledger = self._handler.admission.ledger
        if ledger.standing(endpoint.id) is Standing.SLOW:
            prefetch = min(prefetch, ledger.slow_prefetch())
        return prefetch

    def refit(self) -> None:
        """Endpoints whose prefetch should change (one turned slow or answers again, or the number of
        slow endpoints halved or doubled) are consumed again with the new one. Called every few seconds,
        not on every change of standing: an endpoint whose answers hover around the slow line is
        re-attached at most that often."""
        for consumer in self.active.values():
            wanted = consumer.wanted
            if wanted.mode is not Mode.DELIVER:
                continue
            endpoint = self._registry.get(wanted.endpoint_id)
            if endpoint is not None and self._prefetch(endpoint) != wanted.prefetch:
                self._changes.put(wanted.endpoint_id)

    async def _attach(self, queue_name: str, want: _Wanted) -> None:
        queue = await self._existing_queue(queue_name, want)
        if queue is None:
            return
        channel = await self._channel_for(want.prefetch)
        callback = {
            Mode.DELIVER: partial(self._deliver, want.endpoint_id),
            Mode.FORWARD: partial(self._forward, want.endpoint_id),
            Mode.GONE: partial(self._gone, want.endpoint_id),
        }[want.mode]
        tag = await consumed.consume(channel, queue_name, callback, timeout_s=CALL_TIMEOUT_S)
        self.active.add(queue_name, _Consumer(want, tag, channel))
        # With its tag: what the broker's cancel names, and `rabbitmqctl list_consumers` shows.
        log.info(
            "consumer_attached" if want.mode is Mode.DELIVER else "queue_draining",
            queue=queue_name, endpoint_id=want.endpoint_id, mode=want.mode.value, tag=tag, prefetch=want.prefetch,
        )  # fmt: skip

    async def _existing_queue(self, queue_name: str, want: _Wanted) -> AbstractQueue | None:
        """The queue, checked to exist first: consuming a missing queue would close the consumer channel
        with every consumer on it. A missing current queue is provisioned again; a missing queue that is
        only drained has been removed once empty, and stays removed."""
        queue = await self._queues.find(queue_name)
        endpoint = self._registry.get(want.endpoint_id)
        if (
            queue is not None
            or want.mode is not Mode.DELIVER
            or endpoint is None
            or not self._registry.placements.isolated(
                endpoint
            )  # back in its lane: its queue was removed once drained
        ):
            self._missing_since_s.pop(queue_name, None)
            return queue
        # Not at once: the other replicas' consumers of the queue deleted must have been told first.
        now_s = time.monotonic()
        missing_for_s = now_s - self._missing_since_s.setdefault(queue_name, now_s)
        if missing_for_s < topology.REDECLARE_AFTER_S:
            self._changes.put_later(topology.REDECLARE_AFTER_S - missing_for_s, want.endpoint_id)
            return None
        del self._missing_since_s[queue_name]
        log.error("endpoint_queue_missing", endpoint_id=endpoint.id, queue=queue_name, alert=True)
        metrics.QUEUES_REDECLARED.inc()
        await topology.declare_own_queue(await self._queues.channel(), endpoint)
        return await self._queues.find(queue_name)

    async def _deliver(self, endpoint_id: str, message: Incoming) -> None:
        await self._handling.track(endpoint_id, partial(handle_safely, self._handler, endpoint_id), message)

    async def _forward(self, endpoint_id: str, message: Incoming) -> None:
        await self._handling.track(
            endpoint_id, partial(self._handler.forwarding.forward, endpoint_id), message
        )

    async def _gone(self, endpoint_id: str, message: Incoming) -> None:
        await self._handling.track(endpoint_id, partial(self._handler.settling.gone, endpoint_id), message)

    @property
    def consuming(self) -> int:
        return sum(consumer.wanted.mode is Mode.DELIVER for consumer in self.active.values())

    def lost_with(self, channel: AbstractChannel | None) -> list[str]:
        """The consumers on a channel that closed, let go of; their endpoints reconciled again."""
        lost = [name for name, consumer in self.active.items() if consumer.channel is channel]
        for name in lost:
            self._changes.put(self.active.pop(name).wanted.endpoint_id)
        return lost

    def cancelled(self, consumer_tag: str | None) -> bool:
        """Whether the consumer the broker cancelled was one of these (let go of, reconciled again)."""
        for name, consumer in self.active.items():
            if consumer.tag == consumer_tag:
                log.warning(
                    "consumer_cancelled_by_broker",
                    queue=name, endpoint_id=consumer.wanted.endpoint_id, tag=consumer_tag,
                )  # fmt: skip
                self.active.pop(name)
                self._changes.put(consumer.wanted.endpoint_id)
                return True
        return False

    async def cancel_all(self) -> None:
        for consumer in self.active.values():
            # A channel already gone has stopped delivering anyway.
            with contextlib.suppress(*BROKER_ERRORS):
                await consumed.cancel(consumer.channel, consumer.tag, timeout_s=CALL_TIMEOUT_S)


async def refit_prefetch(own_queues: OwnQueues, loop: Loop) -> None:
    while True:
        own_queues.refit()
        loop.mark_up()
        await asyncio.sleep(REFIT_EVERY_S)
