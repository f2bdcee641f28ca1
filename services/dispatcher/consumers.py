"""Which queues this dispatcher consumes, kept in line with the endpoint log and the breakers.

Every lane (:mod:`hookline.shared.broker.topology`), always: a message from ``events`` is fanned out to the
tenant's endpoints (fanout.py), one addressed to an endpoint is handled for it. Every holding lane,
always: each message there is a held endpoint's copy (isolated past the bound on queues of their own),
the next one of a half-open breaker's taken as its probe by the replica named. And for every endpoint
with a queue of its own (:mod:`hookline.shared.broker.placement`), and only those:
- its current queue is consumed for delivery while the endpoint is active, verified and its breaker
  is closed (an open breaker leaves its messages waiting in the queue); one dispatcher, named by the
  monitor, takes the half-open probe with ``basic.get``;
- the queues it left behind (a queue move) are consumed to forward whatever is still in them, or comes
  back to them late, to its address;
- once it is deleted, all its queues are consumed to turn what is left into ``endpoint_gone`` dead
  letters, until the monitor removes them.

A supervised loop applies the changes one at a time, so a quick create-then-delete never leaves a
consumer behind. When a channel closes under it, the endpoints it served are reconciled again on a
new one; when the connection is lost, the loop starts over and attaches to everything afresh. A current
queue found missing (deleted by hand, lost with a node) is provisioned again, and said so.

Each part lives in its own module: the changes taken one at a time (changes.py), the lanes
(laneconsumers.py), queues of their own (ownqueues.py), half-open probes and breaker leases (breakers.py),
the check with the broker (brokercheck.py), and the handlings under way (handling.py). This module runs
the loop, keeps a channel per prefetch value, and answers for the whole when a channel closes or the
broker cancels.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import aiormq
import structlog
from aio_pika.abc import AbstractChannel

from hookline.dispatcher.breakers import Probes
from hookline.dispatcher.brokercheck import BrokerCheck
from hookline.dispatcher.changes import LANES, RECONCILE_RETRY_S, Changes
from hookline.dispatcher.handler import Handler
from hookline.dispatcher.handling import Handling
from hookline.dispatcher.laneconsumers import LaneConsumers
from hookline.dispatcher.ownqueues import OwnQueues
from hookline.shared.broker.amqp import BROKER_ERRORS, Broker, QueueProbe, close_quietly, on_cancel
from hookline.shared.contracts.control import BreakerView
from hookline.shared.runtime.supervision import Loop
from hookline.shared.state.registry import EndpointRegistry

log = structlog.get_logger(__name__)

#: Endpoints attached at once when the loop (re)starts: each takes two round trips to the broker
#: (check the queue, consume it), so a replica joining 10,000 endpoints must not take them in turn.
ATTACH_CONCURRENCY = 16
#: Deleted endpoints whose queues are still drained: the monitor removes drained queues well before.
DELETED_DRAIN_WINDOW = timedelta(days=1)


class Consumers:
    def __init__(
        self,
        broker: Broker,
        registry: EndpointRegistry,
        breakers: BreakerView,
        handler: Handler,
        dispatcher_id: str,
        *,
        default_prefetch: int,
        lane_prefetch: int,
        sync: Callable[[], Awaitable[None]],
    ) -> None:
        self._broker = broker
        self._registry = registry
        self._sync = sync
        self._handler = handler
        # basic.qos applies to the consumers created after it: one channel per prefetch value keeps
        # every consumer's cap right.
        self._channels: dict[int, AbstractChannel] = {}
        self._opening = asyncio.Lock()  # one channel per prefetch value, also while attaching in parallel
        self._queues = QueueProbe(broker)  # declares: an error there closes its channel, not a consumer's
        self._checks = QueueProbe(broker)  # the check with the broker's, apart from the attaching's
        self.changes = Changes()
        self.handling = Handling(handler.acks)
        self.probes = Probes(broker, registry, breakers, handler, dispatcher_id, self.handling, self.changes)
        self._lanes = LaneConsumers(
            handler, self.handling, self.probes, self.changes, self._queues, self._channel_for,
            lane_prefetch=lane_prefetch,
        )  # fmt: skip
        self.own_queues = OwnQueues(
            registry, breakers, handler, self.handling, self.changes, self._queues, self._channel_for,
            default_prefetch=default_prefetch,
        )  # fmt: skip
        self.check = BrokerCheck(self._lanes, self.own_queues, self._checks, self.changes)

    # --- the loop -----------------------------------------------------------------------------------

    async def run(self, loop: Loop) -> None:
        """Attach to every queue this dispatcher should consume, then apply changes as they come."""
        await self._forget_all()
        try:
            await self._broker.connection()
            self.changes.connection_lost.clear()
            # Caught up with the change log first: a lane message is fanned out to the endpoints this
            # replica knows, so it must know every one registered before the message.
            await self._sync()
            await self._attach_all(self._endpoint_ids())
            await self._lanes.attach()
            loop.mark_up()
            while (changed := await self.changes.next()) is not None:
                await self._reconcile_or_retry(changed)
                loop.beat()
            await asyncio.Event().wait()  # stopping: nothing more to attach to until the supervisor stops us
        finally:
            if not self.changes.stopping:
                # No consumer outlives the loop that reconciles it: until the loop runs again (after a
                # pause), a breaker that opens would have their messages handed back and redelivered
                # to them in a tight loop, up to the queue's delivery limit (then dead letters).
                await self._forget_all()

    async def _attach_all(self, endpoint_ids: list[str]) -> None:
        # Changes that arrive meanwhile wait in the queue and are applied after, one at a time.
        slots = asyncio.Semaphore(ATTACH_CONCURRENCY)

        async def attach(endpoint_id: str) -> None:
            async with slots:
                await self._reconcile_or_retry(endpoint_id)

        await asyncio.gather(*(attach(endpoint_id) for endpoint_id in endpoint_ids))

    def _endpoint_ids(self) -> list[str]:
        since = datetime.now(UTC) - DELETED_DRAIN_WINDOW
        live = [endpoint.id for endpoint in self._registry.placements.with_queues()]
        return live + [endpoint.id for endpoint in self._registry.deletions.deleted_with_queues_since(since)]

    async def _reconcile_or_retry(self, endpoint_id: str) -> None:
        if self.changes.stopping:
            return
        try:
            await self._reconcile(endpoint_id)
        except BROKER_ERRORS as exc:
            if not self._broker.connected:
                raise  # the loop starts over once connected again
            # A channel refused something (or is being replaced): try this endpoint again shortly.
            log.warning("consumer_reconcile_failed", endpoint_id=endpoint_id, error=type(exc).__name__)
            self.changes.put_later(RECONCILE_RETRY_S, endpoint_id)

    async def _reconcile(self, endpoint_id: str) -> None:
        if endpoint_id == LANES:
            await self._lanes.reattach()
            return
        await self.own_queues.reconcile(endpoint_id)
        self.probes.maybe_probe(endpoint_id)

    async def _channel_for(self, prefetch: int) -> AbstractChannel:
        async with self._opening:
            channel = self._channels.get(prefetch)
            if channel is None or channel.is_closed:
                channel = await self._broker.open_channel(prefetch=prefetch)
                channel.close_callbacks.add(partial(self._on_channel_closed, prefetch))
                self._channels[prefetch] = channel
                # A consumer cancelled by the broker (its queue was deleted): attach again, or let go.
                await on_cancel(channel, self._on_consumer_cancelled)
            return channel

    def _on_channel_closed(self, prefetch: int, *_: object) -> None:
        if self.changes.stopping:
            return
        if not self._broker.connected and not self.changes.connection_lost.is_set():
            # What the broker hands out again now, to this replica or another: whatever of it was
            # delivered already is delivered twice (the fault suite counts duplicates against this).
            log.warning("consumers_connection_lost", unacked=self.handling.unacked())
        channel = self._channels.pop(prefetch, None)
        self._handler.acks.forget_closed()
        lost = self.own_queues.lost_with(channel)
        lanes_lost = self._lanes.lost_with(channel)
        if not self._broker.connected:
            self.changes.connection_lost.set()
        elif lost or lanes_lost:
            log.warning(
                "consumer_channel_closed",
                consumers=len(lost),
                lanes=len(lanes_lost),
                unacked=self.handling.unacked(),
            )
            if lanes_lost:
                self.changes.put(LANES)

    def _on_consumer_cancelled(self, frame: aiormq.spec.Basic.Cancel) -> None:
        if self._lanes.cancelled(frame.consumer_tag) or self.own_queues.cancelled(frame.consumer_tag):
            return
        # A consumer this replica had already let go of (cancelled it itself meanwhile).
        log.info("consumer_cancelled_by_broker", tag=frame.consumer_tag, known=False)

    async def _forget_all(self) -> None:
        self.own_queues.active.clear()
        self._lanes.consumed.clear()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await close_quietly(channel)
        await self._queues.close()
        await self._checks.close()

    @property
    def consumer_count(self) -> int:
        """Consumers this replica holds: the lanes', and those of queues of their own."""
        return len(self._lanes.consumed) + len(self.own_queues.active)

    def load(self) -> dict[str, Any]:
        """For heartbeats: deliveries in flight, queues consumed, messages held per endpoint, and the
        half-open breakers whose probe this replica has taken on."""
        probing = self.probes.probing()
        unacked = self.handling.unacked_by_endpoint()
        unacked.update(self._handler.from_lanes())  # parts of lane messages, by endpoint
        return {
            "in_flight": self.handling.in_flight,
            "consumers": self.own_queues.consuming,
            "unacked": dict(unacked),
            "probing": probing,
        }

    # --- shutdown -----------------------------------------------------------------------------------

    async def stop_intake(self) -> None:
        """Cancel every consumer: the broker sends nothing more; what was delivered is still ours."""
        self.changes.stop()
        await self._lanes.cancel_all()
        await self.own_queues.cancel_all()

    async def close_channels(self) -> None:
        """Last: the settled deliveries are acked, whatever is still unacked goes back to its queue."""
        await self._handler.acks.flush()
        await self._forget_all()
