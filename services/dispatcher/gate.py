"""Whether and when a delivery goes: its subject's order, its endpoint's pace (rate limit, a 429's
pause), a connection slot (admission.py), a breaker that opened meanwhile. What would wait too long is
put off through the delay queues instead (same attempt number, the delivery log told why), or from a lane
handed on to the endpoint's queue of its own; and an attempt from a lane that outlives the slow line is
cut there (no attempt counted) and its copy handed on the same way.
"""

from __future__ import annotations

import asyncio
import math
import time

import structlog

from hookline.dispatcher import decoding, metrics
from hookline.dispatcher.acks import Acks
from hookline.dispatcher.admission import Admission, Ended, Standing, Ticket
from hookline.dispatcher.consumed import Incoming
from hookline.dispatcher.delays import Delays
from hookline.dispatcher.ordering import SubjectOrder
from hookline.dispatcher.pacing import Pacer
from hookline.dispatcher.reporting import Telemetry
from hookline.dispatcher.settings import DispatcherSettings
from hookline.dispatcher.settling import Settling
from hookline.shared.contracts.control import BreakerView
from hookline.shared.contracts.models import StoredEndpoint
from hookline.shared.contracts.telemetry import Deferral, DeferralReason
from hookline.shared.state.registry import EndpointRegistry

log = structlog.get_logger(__name__)

#: A message that arrives for an endpoint whose breaker is open is handed back after this pause (from a
#: lane: handed on to the endpoint's address after it, which is its queue of its own once the monitor's
#: isolation of it has arrived).
BREAKER_NACK_PAUSE_S = 1.0
#: A delivery that must wait longer than this for its turn (rate limit, Retry-After) is deferred
#: through the delay queues instead of holding its message.
MAX_LOCAL_WAIT_S = 10.0
#: A delivery that waits this long for a connection slot (its endpoint is slow, and so are enough others
#: to fill their share) is put off by SLOW_SHARE_DEFER_S instead: far from the broker's consumer_timeout
#: (30 min by default), past which it would close the channel of every endpoint consumed on it.
MAX_SLOT_WAIT_S = 60.0
SLOW_SHARE_DEFER_S = 30.0


class Gate:
    def __init__(
        self,
        settings: DispatcherSettings,
        registry: EndpointRegistry,
        acks: Acks,
        admission: Admission,
        breakers: BreakerView,
        pacer: Pacer,
        order: SubjectOrder,
        delays: Delays,
        telemetry: Telemetry,
        settling: Settling,
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._acks = acks
        self._admission = admission
        self._breakers = breakers
        self._pacer = pacer
        self._order = order
        self._delays = delays
        self._telemetry = telemetry
        self._settling = settling

    async def wait_turn(
        self,
        endpoint: StoredEndpoint,
        parsed: decoding.Inbound,
        sequence: int | None,
        *,
        probe: bool,
        lane: bool = False,
    ) -> tuple[float, DeferralReason] | None:
        """Wait for this delivery's turn (per-subject order, rate limit, 429 pause); or, when the wait
        is long (from a lane: at all), return the seconds to defer the message by instead (no attempt
        is spent), and why."""
        now_s = time.time()
        if sequence is not None:
            assert parsed.event.subject is not None
            order_s = self._order.admit(
                endpoint.id, parsed.event.subject, parsed.event.id, sequence, now_s=now_s
            )
            if order_s is not None:
                return order_s, "ordering"
        if probe:
            return None  # the one delivery a half-open breaker lets through goes now
        max_wait_s = 0.0 if lane else MAX_LOCAL_WAIT_S
        wait_s = self._pacer.wait_s(
            endpoint.id, endpoint.rate_limit_per_s, now_s=now_s, max_wait_s=max_wait_s
        )
        if wait_s > max_wait_s:
            return wait_s, "pacing"
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        return None

    async def defer(
        self,
        message: Incoming,
        endpoint: StoredEndpoint,
        parsed: decoding.Inbound,
        sequence: int | None,
        delay_s: float,
        reason: DeferralReason,
    ) -> None:
        """Not this event's turn yet: through the delay queues again, same attempt number, then ack; the
        delivery log is told why (telemetry). Put off for its own endpoint's reasons (not behind an
        earlier event of its subject), it keeps its place in its subject's order meanwhile."""
        event = parsed.event
        if sequence is not None and reason != "ordering":
            assert event.subject is not None
            self._order.retrying(endpoint.id, event.subject, event.id, due_s=time.time() + delay_s)
        await self._delays.schedule(
            message.body,
            content_type=message.content_type,
            timestamp=message.timestamp,
            event_id=parsed.event.id,
            endpoint_id=endpoint.id,
            destination=self._registry.placements.address(endpoint),
            next_attempt=parsed.attempt,
            first_attempt_at_s=parsed.first_attempt_at_s or time.time(),
            delay_s=max(1, math.ceil(delay_s)),
            sequence=sequence,
            trace=parsed.trace,
        )
        await self._acks.ack(message)
        behind = (
            self._order.holding(endpoint.id, event.subject, event.id)
            if reason == "ordering" and event.subject is not None
            else None
        )
        now_s = time.time()
        metrics.DEFERRED.labels(reason).inc()
        self._telemetry.deferral(
            Deferral(
                at_s=now_s, dispatcher_id=self._telemetry.dispatcher_id, event_id=event.id, endpoint_id=endpoint.id,
                tenant=event.tenant, reason=reason, behind_event_id=behind, until_s=now_s + max(1, math.ceil(delay_s)),
            )
        )  # fmt: skip
        log.info(
            "delivery_deferred", event_id=event.id, endpoint_id=endpoint.id, delay_s=math.ceil(delay_s),
            reason=reason, behind_event_id=behind,
        )  # fmt: skip

    async def admitted(
        self,
        message: Incoming,
        endpoint: StoredEndpoint,
        parsed: decoding.Inbound,
        sequence: int | None,
        *,
        probe: bool,
        lane: bool = False,
    ) -> Ticket | None:
        """A connection slot for the attempt (admission.py); None when the message was handled instead:
        put off (no slot within MAX_SLOT_WAIT_S, or a 429 pause began while it waited), handed back
        (its breaker opened while it waited), or, from a lane, handed on to the endpoint's queue of its
        own (no slot within HOOKLINE_SLOW_ATTEMPT_S, the endpoint slow or holding more than its share of
        them)."""
        max_wait_s = self._settings.slow_attempt_s if lane else MAX_SLOT_WAIT_S
        ticket = await self._admission.acquire(endpoint.id, max_wait_s=max_wait_s)
        ledger = self._admission.ledger
        its_own = ledger.standing(endpoint.id) is Standing.SLOW or ledger.holds_more_than_its_share(
            endpoint.id
        )
        if ticket is None and lane and not its_own:
            # The slots are taken by other endpoints, or by many alike: this replica is busy, not this
            # endpoint slow or hogging them. Isolating it would only write its copy once more (at a
            # hundred thousand endpoints with one event each, a saturated receiver host made it twenty
            # thousand isolations at once).
            ticket = await self._admission.acquire(endpoint.id, max_wait_s=MAX_SLOT_WAIT_S - max_wait_s)
        if ticket is None:
            slow = ledger.standing(endpoint.id) is Standing.SLOW
            if lane and its_own and await self._settling.isolate(endpoint, "slow" if slow else "backlogged"):
                await self._settling.hand_on(message, endpoint, reason="no_slot")
            else:
                await self.defer(message, endpoint, parsed, sequence, SLOW_SHARE_DEFER_S, "slow_share")
            return None
        event = parsed.event
        if not probe and self._breakers.state(endpoint.id) is not None:
            # Back to the queue, unattempted (the consumer is cancelled by now: the queue keeps it for
            # the probe); from a lane, on to the endpoint's address.
            self._admission.release(ticket, Ended.NOT_SENT)
            if sequence is not None:  # back in the queue: still ahead of its subject's later events
                assert event.subject is not None
                self._order.retrying(endpoint.id, event.subject, event.id, due_s=time.time())
            if lane:
                await self._settling.hand_on(
                    message, endpoint, delay_s=int(BREAKER_NACK_PAUSE_S), reason="breaker_open"
                )
            else:
                await self._acks.nack(message, requeue=True)
            return None
        paused_s = 0.0 if probe else self._pacer.paused_for_s(endpoint.id, now_s=time.time())
        if paused_s > 0:
            self._admission.release(ticket, Ended.NOT_SENT)
            await self.defer(message, endpoint, parsed, sequence, paused_s, "pacing")
            return None
        return ticket

    async def cut(self, message: Incoming, endpoint: StoredEndpoint, parsed: decoding.Inbound) -> None:
        """An attempt from a lane that outlived the slow line: not the endpoint's failure (no attempt is
        counted), its copy handed to the endpoint's queue of its own, where it goes out again with the
        endpoint's whole timeout (the receiver may have had the request: at least once). Past the bound
        on queues of their own, put off instead."""
        event = parsed.event
        if self._registry.get(endpoint.id) is None:
            # Deleted while the attempt was under way: kept as a dead letter, like any copy of it left.
            await self._settling.gone(endpoint.id, message)
            delay_s = 0
        elif await self._settling.isolate(endpoint, "slow"):
            await self._settling.hand_on(message, endpoint, reason="slow")
            delay_s = 0
        else:
            await self._delays.schedule(
                message.body, content_type=message.content_type, timestamp=message.timestamp,
                event_id=event.id, endpoint_id=endpoint.id, destination=self._registry.placements.address(endpoint),
                next_attempt=parsed.attempt, first_attempt_at_s=parsed.first_attempt_at_s or time.time(),
                delay_s=int(SLOW_SHARE_DEFER_S), sequence=None, trace=parsed.trace,
            )  # fmt: skip
            await self._acks.ack(message)
            delay_s = int(SLOW_SHARE_DEFER_S)
        now_s = time.time()
        metrics.DEFERRED.labels("slow").inc()
        self._telemetry.deferral(
            Deferral(
                at_s=now_s, dispatcher_id=self._telemetry.dispatcher_id, event_id=event.id,
                endpoint_id=endpoint.id, tenant=event.tenant, reason="slow", behind_event_id=None,
                until_s=now_s + delay_s,
            )
        )  # fmt: skip
        log.info(
            "delivery_cut", event_id=event.id, endpoint_id=endpoint.id, after_s=self._settings.slow_attempt_s,
            handed_on=delay_s == 0,
        )  # fmt: skip
