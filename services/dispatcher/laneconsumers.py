"""Consuming the lanes and the holding lanes: every one, always, on one channel of the lane prefetch.

A lane's message from ``events`` is fanned out to the tenant's endpoints (fanout.py), one addressed to an
endpoint is handled for it, a fence is passed (forwarding.py), a stray kept as a dead letter. Each message
in a holding lane is a held endpoint's copy (isolated past the bound on queues of their own), the next
one of a half-open breaker's taken as its probe by the replica named (breakers.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from functools import partial

import structlog
from aio_pika.abc import AbstractChannel

from hookline.dispatcher import consumed, fanout, metrics
from hookline.dispatcher.breakers import Probes
from hookline.dispatcher.changes import LANES, RECONCILE_RETRY_S, Changes
from hookline.dispatcher.consumed import Delivery
from hookline.dispatcher.handler import Handler, handle_safely
from hookline.dispatcher.handling import Handling
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import BROKER_ERRORS, CALL_TIMEOUT_S, QueueProbe
from hookline.shared.contracts import addressing
from hookline.shared.contracts.headers import Header

log = structlog.get_logger(__name__)


def consumed_lanes() -> list[str]:
    return [*topology.lane_queues(), *topology.holding_queues()]


class LaneConsumers:
    def __init__(
        self,
        handler: Handler,
        handling: Handling,
        probes: Probes,
        changes: Changes,
        queues: QueueProbe,
        channel_for: Callable[[int], Awaitable[AbstractChannel]],
        *,
        lane_prefetch: int,
    ) -> None:
        self._handler = handler
        self._handling = handling
        self._probes = probes
        self._changes = changes
        self._queues = queues
        self._channel_for = channel_for
        self._lane_prefetch = lane_prefetch
        self.consumed: dict[str, tuple[str, AbstractChannel]] = {}  # lane -> (consumer tag, channel)

    async def attach(self) -> None:
        channel = await self._channel_for(self._lane_prefetch)
        for name in consumed_lanes():
            tag = await consumed.consume(channel, name, self._callback(name), timeout_s=CALL_TIMEOUT_S)
            self.consumed[name] = (tag, channel)
        log.info("lanes_attached", lanes=len(self.consumed), prefetch=self._lane_prefetch)

    def _callback(self, name: str) -> Callable[[Delivery], Awaitable[None]]:
        return self._holding if topology.is_holding(name) else self._lane

    async def _lane(self, message: Delivery) -> None:
        if fanout.is_fan_out(message):
            metrics.LANE_FANNED_OUT.inc()
            await self._handling.track("", partial(fanout.fan_out, self._handler), message)
            return
        endpoint_id = addressing.endpoint_named(message.headers)
        metrics.LANE_ADDRESSED.inc()
        if endpoint_id is None:
            await self._handling.track("", self._handler.settling.stray, message)
            return
        if (message.headers or {}).get(Header.FENCE) == endpoint_id:
            await self._handling.track(
                "", partial(self._handler.forwarding.fence, endpoint_id=endpoint_id), message
            )
            return
        await self._handling.track(
            endpoint_id, partial(handle_safely, self._handler, endpoint_id, lane=True), message
        )

    async def _holding(self, message: Delivery) -> None:
        endpoint_id = addressing.endpoint_named(message.headers)
        metrics.LANE_HELD.inc()
        if endpoint_id is None:
            await self._handling.track("", self._handler.settling.stray, message)
            return
        await self._handling.track(endpoint_id, partial(self._probes.held, endpoint_id), message)

    async def reattach(self) -> None:
        """Lanes whose consumer went (a channel closed, a cancel): attached again on a channel of their own
        prefetch. A lane found missing is declared again by the core topology's owner (the ingest at its
        start, the leading monitor's repair); until then it is retried."""
        missing = [name for name in consumed_lanes() if name not in self.consumed]
        if not missing:
            return
        channel = await self._channel_for(self._lane_prefetch)
        for name in missing:
            if await self._queues.find(name) is None:
                log.error("lane_missing", queue=name, alert=True)
                self._changes.put_later(RECONCILE_RETRY_S, LANES)
                continue
            tag = await consumed.consume(channel, name, self._callback(name), timeout_s=CALL_TIMEOUT_S)
            self.consumed[name] = (tag, channel)
            log.info("lane_attached", queue=name, tag=tag)

    def lost_with(self, channel: AbstractChannel | None) -> list[str]:
        """The lanes consumed on a channel that closed, let go of."""
        lanes_lost = [name for name, (_, lane_channel) in self.consumed.items() if lane_channel is channel]
        for name in lanes_lost:
            del self.consumed[name]
        return lanes_lost

    def cancelled(self, consumer_tag: str | None) -> bool:
        """Whether the consumer the broker cancelled was a lane's (let go of, attached again)."""
        for name, (tag, _) in list(self.consumed.items()):
            if tag == consumer_tag:
                log.error("consumer_cancelled_by_broker", queue=name, tag=tag, alert=True)
                del self.consumed[name]
                self._changes.put(LANES)
                return True
        return False

    async def cancel_all(self) -> None:
        for tag, channel in list(self.consumed.values()):
            with contextlib.suppress(*BROKER_ERRORS):
                await consumed.cancel(channel, tag, timeout_s=CALL_TIMEOUT_S)
