"""One lane message, fanned out to the tenant's endpoints its event matches, acked once every copy is
settled.

An event published to ``events`` reaches its tenant's lane once, however many of the tenant's endpoints
subscribe to it (:mod:`hookline.shared.broker.topology`). Here it is parsed and checked once, matched against
the tenant's endpoints, and handed to the :class:`~hookline.dispatcher.handler.Handler` once per
endpoint as a :class:`Part`: a view of the lane message whose ack settles that endpoint's copy alone.
The handler settles a part as it settles any message (delivered, retry scheduled with a confirm, dead
letter confirmed, or handed on to the endpoint's address with a confirm), so the lane message is acked
only once every part's outcome is recorded somewhere durable. A part that could not be settled (a
publish was not confirmed in time) is handed on alone to its endpoint's address, so the endpoints
already served are not served again; only when that fails too, or the channel is lost, is the lane
message handed back: the broker gives it out again and every part is handled again (at least once: an
endpoint whose copy was already delivered may get it twice; the handler's memory of settled deliveries
spares it when the same replica takes it again).

A part whose handling crashed is handed on alone, through the delay queues, as a message of its own
(the broker's delivery limit then counts that copy, not the lane message), so that one endpoint's poison
never takes the event from the others. A lane message given out more than ``POISON_DELIVERIES`` times
(the dispatcher crashed with it, again and again) is dead-lettered once per endpoint instead, with the
endpoint named.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import aiormq
import structlog

from hookline.dispatcher import decoding, fences, screening
from hookline.dispatcher.consumed import Delivery
from hookline.dispatcher.handler import Handler, handle_safely
from hookline.shared.broker import topology
from hookline.shared.contracts.models import DeadLetterReason, StoredEndpoint

log = structlog.get_logger(__name__)

#: Deliveries of one lane message after which it is dead-lettered per endpoint instead of fanned out.
POISON_DELIVERIES = 20
#: A lane message given out again counts the endpoints deleted, or that left their lane, this recently
#: (see _targets; a left one's queue consumer knows its straight copies from its second ones as long).
REDELIVERY_COUNTS_DELETED = fences.SECOND_COPIES_FOR
#: A lane message counts the endpoints that left their lane this recently (a replica reads a message
#: it was given a moment after it was given it; a minute covers a loop stalled far longer than that).
LEFT_LANE_COUNTS = timedelta(minutes=1)


class Part:
    """One endpoint's copy of a lane message: read like the message, settled on its own."""

    __slots__ = ("_lane", "crashed", "settled")

    def __init__(self, lane: Delivery) -> None:
        self._lane = lane
        self.settled = False  # acked: its outcome is recorded
        self.crashed = False  # its handling crashed: to be handed on alone

    @property
    def body(self) -> bytes:
        return self._lane.body

    @property
    def message_id(self) -> str | None:
        return self._lane.message_id

    @property
    def content_type(self) -> str | None:
        return self._lane.content_type

    @property
    def headers(self) -> Mapping[str, Any] | None:
        return self._lane.headers

    @property
    def timestamp(self) -> datetime | None:
        return self._lane.timestamp

    @property
    def exchange(self) -> str | None:
        return self._lane.exchange

    @property
    def routing_key(self) -> str | None:
        return self._lane.routing_key

    @property
    def delivery_tag(self) -> int | None:
        return None  # never acked at the broker by itself (acks.py acks it at once: here)

    @property
    def redelivered(self) -> bool | None:
        return self._lane.redelivered

    @property
    def channel(self) -> aiormq.abc.AbstractChannel:
        return self._lane.channel

    async def ack(self) -> None:
        self.settled = True

    async def nack(self, *, requeue: bool = True) -> None:
        del requeue  # not settled: the lane message is handed back, and this part handled again

    async def reject(self, *, requeue: bool = False) -> None:
        del requeue
        self.crashed = True


def _tenant_and_type(routing_key: str | None) -> tuple[str, str]:
    tenant, _, event_type = (routing_key or "").partition(".")
    return tenant, event_type


async def fan_out(handler: Handler, message: Delivery) -> bool:
    """Handle a lane message that came from ``events``; True when it was acked (every part settled),
    False when it was handed back to be given out again."""
    tenant, event_type = _tenant_and_type(message.routing_key)
    targets = _targets(handler, message, tenant, event_type)
    parsed = await handler.reader.parse_event(message, tenant=tenant)
    if isinstance(parsed, decoding.Invalid):
        await handler.settling.dead_letter_invalid(message, parsed, tenant=tenant, endpoints=targets)
        await handler.acks.ack(message)
        return True
    targets = screening.admitted(parsed.event, targets)
    if not targets:  # filtered out everywhere
        await handler.acks.ack(message)
        return True
    if _delivered_too_often(message):
        log.error(
            "lane_message_poison", event_id=parsed.event.id, tenant=tenant, endpoints=len(targets), alert=True
        )
        for endpoint in targets:
            await handler.settling.dead_letter_part(
                message, endpoint, DeadLetterReason.DELIVERY_LIMIT, parsed
            )
        await handler.acks.ack(message)
        return True
    parts = [(endpoint.id, Part(message)) for endpoint in targets]
    if len(parts) == 1:  # most lane messages: no task of its own for the one part
        await handle_safely(handler, parts[0][0], parts[0][1], parsed=parsed, lane=True)
    else:
        await asyncio.gather(
            *(
                handle_safely(handler, endpoint_id, part, parsed=parsed, lane=True)
                for endpoint_id, part in parts
            )
        )
    for endpoint_id, part in parts:
        if part.settled:
            continue
        if part.crashed:
            await _hand_on_alone(handler, endpoint_id, part, reason="crashed")
        elif not message.channel.is_closed:
            # A broker error in the middle of its settlement (a publish not confirmed in time): this copy
            # alone goes on, so that the endpoints already served are not served again by whichever
            # replica the lane message would be given to next. (On a lost channel the broker gives the
            # lane message out again by itself: a copy handed on too would only double this one.)
            await _hand_on_alone(handler, endpoint_id, part, reason="unsettled")
    unsettled = [endpoint_id for endpoint_id, part in parts if not part.settled]
    if not unsettled:
        await handler.acks.ack(message)
        return True
    log.warning(
        "lane_message_handed_back", event_id=parsed.event.id, tenant=tenant, endpoints=unsettled[:10],
        unsettled=len(unsettled), of=len(parts),
    )  # fmt: skip
    await handler.acks.nack(message, requeue=True)
    return False


async def _hand_on_alone(handler: Handler, endpoint_id: str, part: Part, *, reason: str) -> None:
    endpoint = handler.registry.get(endpoint_id)
    try:
        if endpoint is None:  # deleted meanwhile: its copy is kept as a dead letter, like any left
            await handler.settling.gone(endpoint_id, part)
        else:
            await handler.settling.hand_on(part, endpoint, delay_s=1, reason=reason)
    except Exception as exc:  # the lane message is handed back instead: every part is done again
        log.warning("part_not_handed_on", endpoint_id=endpoint_id, error=type(exc).__name__)


def _targets(handler: Handler, message: Delivery, tenant: str, event_type: str) -> Sequence[StoredEndpoint]:
    """The endpoints the lane message is fanned out to: the tenant's laned endpoints it matches, and those
    that left their lane a moment ago (made ordered, their queue of their own now bound to ``events``):
    the fence that let them leave proves every lane message before it was given out, not that the
    replica it went to has read it yet; the copy is handed on (a duplicate at worst, never a loss).
    Given out again (its dispatcher died before it acked), it may have been published long before: then
    those that left within ``REDELIVERY_COUNTS_DELETED`` count, and the endpoints deleted as long ago
    whose fence has passed since, their copies kept as ``endpoint_gone`` dead letters (never lost; one
    published after the deletion is kept so too, never sent)."""
    registry = handler.registry
    targets = registry.subscriptions.matching(tenant, event_type)
    within = REDELIVERY_COUNTS_DELETED if message.redelivered else LEFT_LANE_COUNTS
    left = registry.subscriptions.left_lane(tenant, event_type, within=within)
    if not message.redelivered:
        return (*targets, *left) if left else targets
    since = datetime.now(UTC) - REDELIVERY_COUNTS_DELETED
    known = {endpoint.id for endpoint in targets}
    gone = [
        e for e in registry.deletions.deleted_matching(tenant, event_type, since=since) if e.id not in known
    ]
    return (*targets, *left, *gone)


def _delivered_too_often(message: Delivery) -> bool:
    count = (message.headers or {}).get("x-delivery-count")
    return isinstance(count, int) and count >= POISON_DELIVERIES


def is_fan_out(message: Delivery) -> bool:
    """A lane message published by an upstream (to ``events``), as against one hookline addressed to one
    endpoint (a retry, a hand-off, a replay)."""
    return message.exchange == topology.EVENTS_EXCHANGE
