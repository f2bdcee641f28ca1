"""One message for one endpoint (from its queue of its own, from its lane, or a lane message's part for
it: fanout.py), handled to exactly one settlement.

Every message ends in one of: acked after a 2xx; acked after its retry copy was confirmed by the
broker; acked after its dead letter was confirmed; acked after it was handed on to the endpoint's
address with a confirm (it was in the wrong place: the endpoint is isolated, or its breaker is open).
A handler that is cancelled (shutdown) or loses its channel leaves the message unacked, so the broker
redelivers it: nothing is acked before its outcome is recorded somewhere durable.

What comes from a lane is never held long, since other endpoints' events wait behind it: no wait for
its turn (it is put off instead), a connection slot within ``HOOKLINE_SLOW_ATTEMPT_S`` or the endpoint
is isolated, and an attempt that outlives that is cut there and its copy handed to the endpoint's queue
of its own (isolation.py), where it goes out with the endpoint's whole timeout.

Where each part of it lives: the event read and checked (reading.py); its lane turns (lanes.py);
its order, pace and slot, or put off instead, and an attempt from a lane cut (gate.py); the attempt and
its request (attempt.py); its settlement, hand-offs and dead letters (settling.py); messages in the
wrong place and lane fences (forwarding.py). This module takes a message to one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime

import structlog

from hookline.dispatcher import decoding, fences, metrics, screening
from hookline.dispatcher.acks import Acks
from hookline.dispatcher.admission import Admission, Ledger
from hookline.dispatcher.attempt import Attempts
from hookline.dispatcher.consumed import Incoming
from hookline.dispatcher.delays import Delays
from hookline.dispatcher.forwarding import Forwarding
from hookline.dispatcher.gate import BREAKER_NACK_PAUSE_S, Gate
from hookline.dispatcher.lanes import LaneDeliveries
from hookline.dispatcher.ordering import SubjectOrder
from hookline.dispatcher.pacing import Pacer
from hookline.dispatcher.reading import EventReader
from hookline.dispatcher.reporting import Telemetry
from hookline.dispatcher.settings import DispatcherSettings
from hookline.dispatcher.settled import Settled
from hookline.dispatcher.settling import Settling
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import BROKER_ERRORS, Publisher
from hookline.shared.broker.isolation import Isolation
from hookline.shared.contracts.control import BreakerView
from hookline.shared.contracts.headers import Header
from hookline.shared.contracts.models import DeadLetterReason, Event, StoredEndpoint
from hookline.shared.outbound.delivery import DeliveryClient
from hookline.shared.outbound.sealing import Sealer
from hookline.shared.outbound.transforms import Transformer
from hookline.shared.runtime.tracing import Tracing
from hookline.shared.state.registry import ChangeLog, EndpointRegistry

log = structlog.get_logger(__name__)

# A handler that crashes hands its message back after this pause; the queue's delivery limit turns a
# message that keeps crashing it into a dead letter.
CRASH_PAUSE_S = 1.0
#: A lane copy of an event that most likely reached its endpoint straight from ``events`` too waits this
#: long, so that the replica delivering from the endpoint's queue has settled the other by then.
SECOND_COPY_AFTER_S = 5


def _subscribed(endpoint: StoredEndpoint, message: Incoming) -> bool:
    """Whether a message is meant for the endpoint by its patterns: always, unless it came from ``events``
    (to its queue of its own, bound there directly) with a type none of them matches."""
    if message.exchange != topology.EVENTS_EXCHANGE:
        return True
    tenant, _, event_type = (message.routing_key or "").partition(".")
    return tenant != endpoint.tenant or any(
        topology.topic_matches(pattern, event_type) for pattern in endpoint.event_types
    )


def _order_key(event: Event, parsed: decoding.Inbound) -> int:
    """Where an ordered endpoint puts the event among those of its subject: the publisher's
    ``sequence`` when it gave one, else when this dispatcher first saw it (ns, kept across retries)."""
    if event.sequence is not None:
        return event.sequence
    return parsed.sequence or time.time_ns()


class Handler:
    def __init__(
        self,
        settings: DispatcherSettings,
        change_log: ChangeLog,
        client: DeliveryClient,
        publisher: Publisher,
        telemetry: Telemetry,
        breakers: BreakerView,
        sealer: Sealer,
        *,
        isolation: Isolation | None = None,
        tracing: Tracing | None = None,
        transformer: Transformer | None = None,
        random_unit: Callable[[], float] = random.random,
    ) -> None:
        self.acks = Acks()
        self.admission = Admission(
            Ledger(
                slots=settings.http_max_connections,
                slow_slots=max(1, round(settings.http_max_connections * settings.slow_share)),
                slow_after_s=settings.slow_attempt_s,
            )
        )
        self._registry = change_log.registry
        self._breakers = breakers
        self._settled = Settled()
        self._order = SubjectOrder(stale_s=settings.order_hold_s)
        pacer = Pacer()
        delays = Delays(publisher)
        self.settling = Settling(
            settings, change_log, publisher, delays, self.acks, self._settled, self._order, isolation
        )
        self.reader = EventReader(settings, change_log)
        self.forwarding = Forwarding(settings, change_log, publisher, self.acks, self.settling, isolation)
        self._gate = Gate(
            settings, self._registry, self.acks, self.admission, breakers, pacer, self._order, delays,
            telemetry, self.settling,
        )  # fmt: skip
        self._attempts = Attempts(
            settings, client, sealer, telemetry, self.admission, pacer, self._gate, self.settling,
            tracing=tracing, transformer=transformer, random_unit=random_unit,
        )  # fmt: skip
        self._lanes = LaneDeliveries(
            settings, self._registry, self.admission, breakers, self.settling, self._handle
        )

    @property
    def registry(self) -> EndpointRegistry:
        return self._registry

    def from_lanes(self) -> dict[str, int]:
        """Deliveries from lanes under way, per endpoint (for heartbeats: what a delete waits for)."""
        return self._lanes.from_lanes()

    async def handle(
        self,
        endpoint_id: str,
        message: Incoming,
        *,
        probe: bool = False,
        parsed: decoding.Inbound | None = None,
        lane: bool = False,
        held: bool = False,
    ) -> bool:
        """Handle one message to its settlement; True when an attempt was made (what a probe needs).
        ``parsed``: the event, read already (a lane message's parts); ``lane``: it came from a lane;
        ``held``: from a holding lane."""
        endpoint = self._registry.get(endpoint_id)
        if endpoint is None:
            # Deleted while this message was on its way: its queue is drained into the dead letters.
            await self.settling.gone(endpoint_id, message)
            return False
        if held:
            return await self._lanes.from_holding(endpoint, message, probe=probe)
        if not lane and not _subscribed(endpoint, message):
            # Routed straight to its queue of its own for a pattern it has dropped since (a direct
            # route: the leading monitor unbinds it soon); its lane would not have fanned it out to it.
            await self.acks.ack(message)
            metrics.UNSUBSCRIBED.inc()
            log.info("event_not_subscribed", endpoint_id=endpoint.id, event_id=message.message_id)
            return False
        if lane and self._registry.placements.isolated(endpoint):
            # Its events go to its queue of its own (a part of a lane message, or a message that came to
            # the lane before the endpoint was isolated). That queue bound to events (an ordered endpoint
            # leaving its lane, or left a moment ago: fences.py), the event most likely reached it that
            # way already: the copy says so, and comes once that one is settled (_settled_before).
            if endpoint.straight:
                second: dict[str, object] = {Header.SECOND_COPY: 1}
                await self.settling.hand_on(
                    message, endpoint, reason="isolated", headers=second, delay_s=SECOND_COPY_AFTER_S
                )
            else:
                await self.settling.hand_on(message, endpoint, reason="isolated")
            return False
        if not probe and self._breakers.state(endpoint_id) is not None:
            # Delivered before the breaker opened reached us: back, not attempted. After a pause: until
            # its consumer is cancelled the queue hands it straight back, and every return counts toward
            # the delivery limit.
            if lane:
                await self.settling.hand_on(
                    message, endpoint, delay_s=int(BREAKER_NACK_PAUSE_S), reason="breaker_open"
                )
            else:
                await asyncio.sleep(BREAKER_NACK_PAUSE_S)
                await self.acks.nack(message, requeue=True)
            return False
        if lane and not probe:
            return await self._lanes.from_lane(endpoint, message, parsed)
        return await self._handle(endpoint, message, parsed, probe=probe, lane=False)

    async def _handle(
        self,
        endpoint: StoredEndpoint,
        message: Incoming,
        parsed_before: decoding.Inbound | None,
        *,
        probe: bool,
        lane: bool,
    ) -> bool:
        parsed = parsed_before or await self.reader.parse_event(message, tenant=endpoint.tenant)
        if isinstance(parsed, decoding.Invalid):
            await self.settling.dead_letter(
                message, endpoint.id, endpoint.tenant, DeadLetterReason.INVALID_EVENT,
                event_id=parsed.event_id, attempts=0, last_status=None, last_error=parsed.reason,
            )  # fmt: skip
            await self.acks.ack(message)
            log.warning(
                "event_invalid",
                endpoint_id=endpoint.id, tenant=endpoint.tenant, event_id=parsed.event_id, reason=parsed.reason,
            )  # fmt: skip
            return False

        event = parsed.event
        if (
            not lane
            and message.exchange == topology.EVENTS_EXCHANGE
            and not screening.admitted(event, (endpoint,))
        ):
            # Routed straight to its queue of its own (a direct route): its filter is applied here.
            await self.acks.ack(message)
            return False
        if await self._settled_before(message, endpoint, parsed):
            return False
        if message.exchange == topology.EVENTS_EXCHANGE and fences.second_copies_may_come(
            endpoint, now=datetime.now(UTC)
        ):
            self._settled.took_straight(endpoint.id, event.id, now_s=time.monotonic())
        sequence = _order_key(event, parsed) if endpoint.ordered and event.subject else None
        deferred = await self._gate.wait_turn(endpoint, parsed, sequence, probe=probe, lane=lane)
        if deferred is not None:
            await self._gate.defer(message, endpoint, parsed, sequence, *deferred)
            return False
        ticket = await self._gate.admitted(message, endpoint, parsed, sequence, probe=probe, lane=lane)
        if ticket is None:
            return False
        try:
            await self._attempts.attempt_and_settle(
                message, endpoint, parsed, sequence, ticket, probe=probe, lane=lane
            )
        except BaseException:
            if sequence is not None:  # never leave the subject blocked by an event that is not out
                assert event.subject is not None
                self._order.done(endpoint.id, event.subject, event.id)
            raise
        return True

    async def _settled_before(
        self, message: Incoming, endpoint: StoredEndpoint, parsed: decoding.Inbound
    ) -> bool:
        """A redelivery of a message this replica settled, whose ack the broker never got, or a second
        copy of an event that came to it straight (both ways to an endpoint leaving its lane): acked
        now, not attempted again (settled.py)."""
        if not (message.redelivered or parsed.second_copy) or parsed.origin is not None:
            return False
        event = parsed.event
        key = (endpoint.id, event.id, parsed.attempt)
        now_s = time.monotonic()
        if parsed.second_copy:
            outcome = self._settled.second_copy(key, now_s=now_s)
        else:
            outcome = self._settled.outcome(key, now_s=now_s)
        if outcome is None:
            return False
        await self.acks.ack(message)
        metrics.REDELIVERIES_SETTLED.inc()
        log.info(
            "redelivery_already_settled",
            event_id=event.id, endpoint_id=endpoint.id, attempt=parsed.attempt, outcome=outcome,
        )  # fmt: skip
        return True


async def handle_safely(
    handler: Handler,
    endpoint_id: str,
    message: Incoming,
    *,
    probe: bool = False,
    parsed: decoding.Inbound | None = None,
    lane: bool = False,
    held: bool = False,
) -> bool:
    """The consumer callback: a crash requeues the message (counted toward the poison limit), and a
    broker error hands it back if the channel still can; neither stops the dispatcher. Returns whether
    an attempt was made."""
    try:
        return await handler.handle(endpoint_id, message, probe=probe, parsed=parsed, lane=lane, held=held)
    except BROKER_ERRORS as exc:
        # A publish or read-back failed mid-settlement: hand the message back (on a lost channel the
        # broker does that by itself); it is tried again.
        log.warning("settle_failed", endpoint_id=endpoint_id, error=type(exc).__name__)
        with contextlib.suppress(*BROKER_ERRORS):
            await handler.acks.nack(message, requeue=True)
    except Exception as exc:
        log.error("handler_crashed", endpoint_id=endpoint_id, error=type(exc).__name__, exc_info=exc)
        # reject (not nack) counts toward x-delivery-limit on every RabbitMQ version, so a message that
        # keeps crashing the handler is dead-lettered by the broker instead of looping for ever.
        await asyncio.sleep(CRASH_PAUSE_S)
        with contextlib.suppress(*BROKER_ERRORS):
            await handler.acks.reject(message, requeue=True)
    return False
