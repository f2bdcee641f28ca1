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
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import Enum
from functools import partial
from typing import Any

import aiormq
import structlog
from aio_pika.abc import AbstractChannel, AbstractQueue

from hookline.dispatcher import consumed, fanout, metrics
from hookline.dispatcher.admission import Standing
from hookline.dispatcher.consumed import Delivery, Incoming
from hookline.dispatcher.handler import Handler, handle_safely
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import (
    BROKER_ERRORS,
    CALL_TIMEOUT_S,
    Broker,
    ChannelLostError,
    QueueProbe,
    close_quietly,
    on_cancel,
)
from hookline.shared.contracts import addressing
from hookline.shared.contracts.control import BreakerState, BreakerView
from hookline.shared.contracts.headers import Header
from hookline.shared.contracts.models import EndpointStatus, StoredEndpoint
from hookline.shared.runtime.supervision import Loop
from hookline.shared.state.registry import EndpointRegistry

log = structlog.get_logger(__name__)

PROBE_POLL_S = 1.0
#: Endpoints attached at once when the loop (re)starts: each takes two round trips to the broker
#: (check the queue, consume it), so a replica joining 10,000 endpoints must not take them in turn.
ATTACH_CONCURRENCY = 16
RECONCILE_RETRY_S = 2.0
#: Deleted endpoints whose queues are still drained: the monitor removes drained queues well before.
DELETED_DRAIN_WINDOW = timedelta(days=1)
#: How often consumers whose prefetch no longer fits their endpoint's standing are consumed again.
REFIT_EVERY_S = 5.0
#: Queues asked about per second when checking the consumers with the broker (passive declares).
CHECKS_PER_S = 50
#: What the change queue carries to say the lanes need attaching again (no endpoint id looks like it).
_LANES = "*lanes*"


def _consumed_lanes() -> list[str]:
    return [*topology.lane_queues(), *topology.holding_queues()]


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
        self._lane_prefetch = lane_prefetch
        self._lanes: dict[str, tuple[str, AbstractChannel]] = {}  # lane -> (consumer tag, channel)
        self._breakers = breakers
        self._handler = handler
        self._dispatcher_id = dispatcher_id
        self._default_prefetch = default_prefetch
        self._active = _Active()
        # basic.qos applies to the consumers created after it: one channel per prefetch value keeps
        # every consumer's cap right.
        self._channels: dict[int, AbstractChannel] = {}
        self._opening = asyncio.Lock()  # one channel per prefetch value, also while attaching in parallel
        self._queues = QueueProbe(broker)  # declares: an error there closes its channel, not a consumer's
        self._checks = QueueProbe(broker)  # the check with the broker's, apart from the attaching's
        self._missing_since_s: dict[str, float] = {}  # current queues found missing, not yet declared again
        self._probes: dict[str, int] = {}  # endpoint id -> the half-open version being probed
        self._changed: asyncio.Queue[str | None] = asyncio.Queue()
        self._connection_lost = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._unacked: Counter[str] = Counter()
        self._stopping = False

    # --- what changed ------------------------------------------------------------------------------

    def on_change(self, before: StoredEndpoint | None, after: StoredEndpoint | None) -> None:
        endpoint_id = (after or before).id  # type: ignore[union-attr]
        self._changed.put_nowait(endpoint_id)

    def on_breakers(self, endpoint_ids: set[str] | list[str]) -> None:
        for endpoint_id in endpoint_ids:
            self._changed.put_nowait(endpoint_id)

    # --- the loop -----------------------------------------------------------------------------------

    async def run(self, loop: Loop) -> None:
        """Attach to every queue this dispatcher should consume, then apply changes as they come."""
        await self._forget_all()
        try:
            await self._broker.connection()
            self._connection_lost.clear()
            # Caught up with the change log first: a lane message is fanned out to the endpoints this
            # replica knows, so it must know every one registered before the message.
            await self._sync()
            await self._attach_all(self._endpoint_ids())
            await self._attach_lanes()
            loop.mark_up()
            while (changed := await self._next_change()) is not None:
                await self._reconcile_or_retry(changed)
                loop.beat()
            await asyncio.Event().wait()  # stopping: nothing more to attach to until the supervisor stops us
        finally:
            if not self._stopping:
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
        live = [endpoint.id for endpoint in self._registry.with_queues()]
        return live + [endpoint.id for endpoint in self._registry.deleted_with_queues_since(since)]

    async def _attach_lanes(self) -> None:
        channel = await self._channel_for(self._lane_prefetch)
        for name in _consumed_lanes():
            tag = await consumed.consume(channel, name, self._lane_callback(name), timeout_s=CALL_TIMEOUT_S)
            self._lanes[name] = (tag, channel)
        log.info("lanes_attached", lanes=len(self._lanes), prefetch=self._lane_prefetch)

    def _lane_callback(self, name: str) -> Callable[[Delivery], Awaitable[None]]:
        return self._holding if topology.is_holding(name) else self._lane

    async def _lane(self, message: Delivery) -> None:
        if fanout.is_fan_out(message):
            metrics.LANE_FANNED_OUT.inc()
            await self.track("", partial(fanout.fan_out, self._handler), message)
            return
        endpoint_id = addressing.endpoint_named(message.headers)
        metrics.LANE_ADDRESSED.inc()
        if endpoint_id is None:
            await self.track("", self._handler.settling.stray, message)
            return
        if (message.headers or {}).get(Header.FENCE) == endpoint_id:
            await self.track("", partial(self._handler.forwarding.fence, endpoint_id=endpoint_id), message)
            return
        await self.track(endpoint_id, partial(handle_safely, self._handler, endpoint_id, lane=True), message)

    async def _holding(self, message: Delivery) -> None:
        endpoint_id = addressing.endpoint_named(message.headers)
        metrics.LANE_HELD.inc()
        if endpoint_id is None:
            await self.track("", self._handler.settling.stray, message)
            return
        await self.track(endpoint_id, partial(self._held, endpoint_id), message)

    async def _held(self, endpoint_id: str, message: Incoming) -> None:
        """A held endpoint's copy; while its breaker is half open, the first to come to the replica the
        monitor named is its probe (a held endpoint has no queue to take one from with ``basic.get``)."""
        breaker = self._breakers.state(endpoint_id)
        probe = (
            breaker is not None
            and breaker.state is BreakerState.HALF_OPEN
            and breaker.probe_by == self._dispatcher_id
            and self._probes.get(endpoint_id) != breaker.version
        )
        if probe:
            assert breaker is not None
            self._probes[endpoint_id] = breaker.version
            log.info("breaker_probe", endpoint_id=endpoint_id, version=breaker.version, held=True)
        attempted = await handle_safely(self._handler, endpoint_id, message, probe=probe, held=True)
        if probe and not attempted:
            self._probes.pop(endpoint_id, None)  # no attempt came of it: probe with the next one

    async def _next_change(self) -> str | None:
        change = asyncio.ensure_future(self._changed.get())
        lost = asyncio.ensure_future(self._connection_lost.wait())
        try:
            await asyncio.wait({change, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
        if change.done():
            return change.result()
        change.cancel()
        raise ChannelLostError("the broker connection was lost; attaching again")

    async def _reconcile_or_retry(self, endpoint_id: str) -> None:
        if self._stopping:
            return
        try:
            await self._reconcile(endpoint_id)
        except BROKER_ERRORS as exc:
            if not self._broker.connected:
                raise  # the loop starts over once connected again
            # A channel refused something (or is being replaced): try this endpoint again shortly.
            log.warning("consumer_reconcile_failed", endpoint_id=endpoint_id, error=type(exc).__name__)
            asyncio.get_running_loop().call_later(RECONCILE_RETRY_S, self._changed.put_nowait, endpoint_id)

    async def _reconcile(self, endpoint_id: str) -> None:
        if endpoint_id == _LANES:
            await self._reattach_lanes()
            return
        wanted = self._wanted(endpoint_id)
        for queue_name, consumer in self._active.of_endpoint(endpoint_id):
            if wanted.get(queue_name) != consumer.wanted:
                # Breaker open, endpoint paused or gone, its cap changed, or the queue was left behind.
                self._active.pop(queue_name)
                with contextlib.suppress(*BROKER_ERRORS):
                    await consumed.cancel(consumer.channel, consumer.tag, timeout_s=CALL_TIMEOUT_S)
        for queue_name, want in wanted.items():
            if queue_name not in self._active:
                await self._attach(queue_name, want)
        self._maybe_probe(endpoint_id)

    def _wanted(self, endpoint_id: str) -> dict[str, _Wanted]:
        endpoint = self._registry.get(endpoint_id)
        if self._stopping:
            return {}
        if endpoint is None:
            gone = self._registry.last_known(endpoint_id)
            if gone is None:
                return {}
            return {name: _Wanted(endpoint_id, Mode.GONE, 1) for name in topology.endpoint_queues(gone)}
        wanted = {name: _Wanted(endpoint_id, Mode.FORWARD, 1) for name in endpoint.retired_queues}
        if (
            self._registry.has_queue(endpoint_id)
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
        for consumer in self._active.values():
            wanted = consumer.wanted
            if wanted.mode is not Mode.DELIVER:
                continue
            endpoint = self._registry.get(wanted.endpoint_id)
            if endpoint is not None and self._prefetch(endpoint) != wanted.prefetch:
                self._changed.put_nowait(wanted.endpoint_id)

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
        self._active.add(queue_name, _Consumer(want, tag, channel))
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
            or not self._registry.isolated(endpoint)  # back in its lane: its queue was removed once drained
        ):
            self._missing_since_s.pop(queue_name, None)
            return queue
        # Not at once: the other replicas' consumers of the queue deleted must have been told first.
        now_s = time.monotonic()
        missing_for_s = now_s - self._missing_since_s.setdefault(queue_name, now_s)
        if missing_for_s < topology.REDECLARE_AFTER_S:
            asyncio.get_running_loop().call_later(
                topology.REDECLARE_AFTER_S - missing_for_s, self._changed.put_nowait, want.endpoint_id
            )
            return None
        del self._missing_since_s[queue_name]
        log.error("endpoint_queue_missing", endpoint_id=endpoint.id, queue=queue_name, alert=True)
        metrics.QUEUES_REDECLARED.inc()
        await topology.declare_own_queue(await self._queues.channel(), endpoint)
        return await self._queues.find(queue_name)

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
        if self._stopping:
            return
        if not self._broker.connected and not self._connection_lost.is_set():
            # What the broker hands out again now, to this replica or another: whatever of it was
            # delivered already is delivered twice (the fault suite counts duplicates against this).
            log.warning("consumers_connection_lost", unacked=self.unacked())
        channel = self._channels.pop(prefetch, None)
        self._handler.acks.forget_closed()
        lost = [name for name, consumer in self._active.items() if consumer.channel is channel]
        for name in lost:
            self._changed.put_nowait(self._active.pop(name).wanted.endpoint_id)
        lanes_lost = [name for name, (_, lane_channel) in self._lanes.items() if lane_channel is channel]
        for name in lanes_lost:
            del self._lanes[name]
        if not self._broker.connected:
            self._connection_lost.set()
        elif lost or lanes_lost:
            log.warning(
                "consumer_channel_closed", consumers=len(lost), lanes=len(lanes_lost), unacked=self.unacked()
            )
            if lanes_lost:
                self._changed.put_nowait(_LANES)

    def _on_consumer_cancelled(self, frame: aiormq.spec.Basic.Cancel) -> None:
        for name, (tag, _) in list(self._lanes.items()):
            if tag == frame.consumer_tag:
                log.error("consumer_cancelled_by_broker", queue=name, tag=tag, alert=True)
                del self._lanes[name]
                self._changed.put_nowait(_LANES)
                return
        for name, consumer in self._active.items():
            if consumer.tag == frame.consumer_tag:
                log.warning(
                    "consumer_cancelled_by_broker",
                    queue=name, endpoint_id=consumer.wanted.endpoint_id, tag=frame.consumer_tag,
                )  # fmt: skip
                self._active.pop(name)
                self._changed.put_nowait(consumer.wanted.endpoint_id)
                return
        # A consumer this replica had already let go of (cancelled it itself meanwhile).
        log.info("consumer_cancelled_by_broker", tag=frame.consumer_tag, known=False)

    async def _reattach_lanes(self) -> None:
        """Lanes whose consumer went (a channel closed, a cancel): attached again on a channel of their own
        prefetch. A lane found missing is declared again by the core topology's owner (the ingest at its
        start, the leading monitor's repair); until then it is retried."""
        missing = [name for name in _consumed_lanes() if name not in self._lanes]
        if not missing:
            return
        channel = await self._channel_for(self._lane_prefetch)
        for name in missing:
            if await self._queues.find(name) is None:
                log.error("lane_missing", queue=name, alert=True)
                asyncio.get_running_loop().call_later(RECONCILE_RETRY_S, self._changed.put_nowait, _LANES)
                continue
            tag = await consumed.consume(channel, name, self._lane_callback(name), timeout_s=CALL_TIMEOUT_S)
            self._lanes[name] = (tag, channel)
            log.info("lane_attached", queue=name, tag=tag)

    async def check_with_broker(self, *, every_s: float) -> None:
        """The safety net under the broker's cancel: each queue this replica consumes is asked how many
        consumers it has (a passive declare), at most CHECKS_PER_S a second and each at least every
        ``every_s``; one the broker finds gone, or with no consumer, is attached again (and provisioned,
        if it is a current queue), as a cancel would have done."""
        started_s = time.monotonic()
        for name, (tag, lane_channel) in list(self._lanes.items()):
            queue = await self._checks.find(name)
            if self._lanes.get(name, (None, None))[0] != tag:
                continue
            if queue is None or not queue.declaration_result.consumer_count:
                log.error(
                    "consumer_missing_at_broker",
                    queue=name,
                    tag=tag,
                    queue_exists=queue is not None,
                    alert=True,
                )
                metrics.CONSUMERS_REATTACHED.inc()
                del self._lanes[name]
                with contextlib.suppress(*BROKER_ERRORS):
                    await consumed.cancel(lane_channel, tag, timeout_s=CALL_TIMEOUT_S)
                self._changed.put_nowait(_LANES)
            await asyncio.sleep(1 / CHECKS_PER_S)
        for name, consumer in self._active.items():
            queue = await self._checks.find(name)
            current = self._active.get(name)
            if current is not consumer:
                continue  # changed meanwhile: the reconcile that did it has looked
            if queue is None or not queue.declaration_result.consumer_count:
                # A queue only drained (left behind, or a deleted endpoint's) is removed once empty.
                if queue is not None or consumer.wanted.mode is Mode.DELIVER:
                    log.error(
                        "consumer_missing_at_broker",
                        queue=name, endpoint_id=consumer.wanted.endpoint_id, tag=consumer.tag,
                        queue_exists=queue is not None, alert=True,
                    )  # fmt: skip
                    metrics.CONSUMERS_REATTACHED.inc()
                self._active.pop(name)
                with contextlib.suppress(*BROKER_ERRORS):
                    await consumed.cancel(consumer.channel, consumer.tag, timeout_s=CALL_TIMEOUT_S)
                self._changed.put_nowait(consumer.wanted.endpoint_id)
            await asyncio.sleep(1 / CHECKS_PER_S)
        await asyncio.sleep(max(0.0, started_s + every_s - time.monotonic()))

    async def _forget_all(self) -> None:
        self._active.clear()
        self._lanes.clear()
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await close_quietly(channel)
        await self._queues.close()
        await self._checks.close()

    # --- the half-open probe ------------------------------------------------------------------------

    def _maybe_probe(self, endpoint_id: str) -> None:
        endpoint = self._registry.get(endpoint_id)
        breaker = self._breakers.state(endpoint_id)
        if (
            endpoint is not None
            and self._registry.has_queue(endpoint_id)  # a held one's probe comes from its holding lane
            and endpoint.status is EndpointStatus.ACTIVE
            and endpoint.verified
            and breaker is not None
            and breaker.state is BreakerState.HALF_OPEN
            and breaker.probe_by == self._dispatcher_id
            and self._probes.get(endpoint_id) != breaker.version
        ):
            self._probes[endpoint_id] = breaker.version
            probe = asyncio.create_task(self._probe(endpoint, breaker.version), name=f"probe:{endpoint_id}")
            self._tasks.add(probe)
            probe.add_done_callback(partial(self._probe_ended, endpoint_id))

    def _probe_ended(self, endpoint_id: str, probe: asyncio.Task[None]) -> None:
        """A probe that ended on an error its loop does not expect (or was cancelled from under it, as a
        channel's pending call is when its connection goes) is started again: the breaker's version is
        still marked as probed, and nothing else would ever probe it, leaving it half open for good."""
        self._tasks.discard(probe)
        if self._stopping or not (probe.cancelled() or probe.exception() is not None):
            return
        error = "cancelled" if probe.cancelled() else type(probe.exception()).__name__
        log.error("breaker_probe_crashed", endpoint_id=endpoint_id, error=error, alert=True)
        self._probes.pop(endpoint_id, None)
        asyncio.get_running_loop().call_later(RECONCILE_RETRY_S, self._changed.put_nowait, endpoint_id)

    async def _probe(self, endpoint: StoredEndpoint, version: int) -> None:
        """Deliver exactly one message while the breaker is half open and this replica is the prober."""

        def still_mine() -> bool:
            command = self._breakers.state(endpoint.id)
            return not self._stopping and command is not None and command.version == version

        queue_name = topology.endpoint_queue(endpoint.id, endpoint.queue_generation)
        while still_mine():
            try:
                async with self._broker.channel() as channel:
                    queue = await channel.get_queue(queue_name, ensure=False)
                    while still_mine():
                        message = await queue.get(no_ack=False, fail=False, timeout=CALL_TIMEOUT_S)
                        if message is None:
                            await asyncio.sleep(PROBE_POLL_S)  # nothing to probe with yet
                            continue
                        log.info("breaker_probe", endpoint_id=endpoint.id, version=version)
                        if await handle_safely(self._handler, endpoint.id, message, probe=True):
                            return
                        # No attempt came of it (an invalid event, a deferral): probe with the next one.
            except BROKER_ERRORS as exc:
                log.warning("breaker_probe_failed", endpoint_id=endpoint.id, error=type(exc).__name__)
                await asyncio.sleep(PROBE_POLL_S)

    # --- consuming ----------------------------------------------------------------------------------

    async def _deliver(self, endpoint_id: str, message: Incoming) -> None:
        await self.track(endpoint_id, partial(handle_safely, self._handler, endpoint_id), message)

    async def _forward(self, endpoint_id: str, message: Incoming) -> None:
        await self.track(endpoint_id, partial(self._handler.forwarding.forward, endpoint_id), message)

    async def _gone(self, endpoint_id: str, message: Incoming) -> None:
        await self.track(endpoint_id, partial(self._handler.settling.gone, endpoint_id), message)

    async def track(
        self,
        endpoint_id: str,
        handle: Callable[[Incoming], Awaitable[object]],
        message: Incoming,
    ) -> None:
        """Run a message's handling as a task the shutdown drain waits for, counted per endpoint."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._unacked[endpoint_id] += 1
        self._handler.acks.delivered(message)
        try:
            await handle(message)
        finally:
            self._tasks.discard(task)
            self._unacked[endpoint_id] -= 1
            if not self._unacked[endpoint_id]:
                del self._unacked[endpoint_id]

    @property
    def consumer_count(self) -> int:
        """Consumers this replica holds: the lanes', and those of queues of their own."""
        return len(self._lanes) + len(self._active)

    @property
    def consuming(self) -> int:
        return sum(consumer.wanted.mode is Mode.DELIVER for consumer in self._active.values())

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def unacked(self) -> int:
        """Messages held without an ack at the broker: being handled, or settled with the ack to go."""
        return sum(self._unacked.values()) + self._handler.acks.pending()

    def load(self) -> dict[str, Any]:
        """For heartbeats: deliveries in flight, queues consumed, messages held per endpoint, and the
        half-open breakers whose probe this replica has taken on."""
        probing = {}
        for endpoint_id, version in list(self._probes.items()):
            breaker = self._breakers.state(endpoint_id)
            if breaker is not None and breaker.state is BreakerState.HALF_OPEN and breaker.version == version:
                probing[endpoint_id] = version
            else:
                del self._probes[endpoint_id]  # decided: closed, or open again with a new version
        unacked = Counter({key: n for key, n in self._unacked.items() if key})
        unacked.update(self._handler.from_lanes())  # parts of lane messages, by endpoint
        return {
            "in_flight": self.in_flight,
            "consumers": self.consuming,
            "unacked": dict(unacked),
            "probing": probing,
        }

    # --- shutdown -----------------------------------------------------------------------------------

    async def stop_intake(self) -> None:
        """Cancel every consumer: the broker sends nothing more; what was delivered is still ours."""
        self._stopping = True
        self._changed.put_nowait(None)
        for tag, channel in list(self._lanes.values()):
            with contextlib.suppress(*BROKER_ERRORS):
                await consumed.cancel(channel, tag, timeout_s=CALL_TIMEOUT_S)
        for consumer in self._active.values():
            # A channel already gone has stopped delivering anyway.
            with contextlib.suppress(*BROKER_ERRORS):
                await consumed.cancel(consumer.channel, consumer.tag, timeout_s=CALL_TIMEOUT_S)

    async def drain(self, grace_s: float) -> int:
        """Wait up to ``grace_s`` for in-flight deliveries; cancel the rest. Returns how many were cancelled.

        A cancelled delivery's message stays unacked, so the broker redelivers it when the channel closes.
        """
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        leftovers = set(self._tasks)
        for task in leftovers:
            task.cancel()
        if leftovers:
            await asyncio.wait(leftovers, timeout=5)
        return len(leftovers)

    async def close_channels(self) -> None:
        """Last: the settled deliveries are acked, whatever is still unacked goes back to its queue."""
        await self._handler.acks.flush()
        await self._forget_all()


async def check_consumers(consumers: Consumers, every_s: float, loop: Loop) -> None:
    loop.mark_up()
    while True:
        await consumers.check_with_broker(every_s=every_s)
        loop.beat()


async def refit_prefetch(consumers: Consumers, loop: Loop) -> None:
    while True:
        consumers.refit()
        loop.mark_up()
        await asyncio.sleep(REFIT_EVERY_S)


async def expire_breakers(breakers: BreakerView, consumers: Consumers, loop: Loop) -> None:
    """Breakers no monitor renewed within the lease are closed here: never blocked on a silent monitor."""
    while True:
        for command in breakers.expire(now_s=time.monotonic()):
            log.error(
                "breaker_expired",
                endpoint_id=command.endpoint_id,
                state=command.state.value,
                alert=True,
                detail="no health monitor renewed this breaker; delivering again",
            )
            metrics.BREAKERS_EXPIRED.inc()
            consumers.on_breakers([command.endpoint_id])
        loop.mark_up()
        await asyncio.sleep(1.0)
