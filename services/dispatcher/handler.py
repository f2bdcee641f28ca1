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
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import cast

import structlog
from opentelemetry.trace import SpanKind

from hookline.dispatcher import decoding, fences, metrics, screening
from hookline.dispatcher.acks import Acks
from hookline.dispatcher.admission import CROWDED_IN_FLIGHT, Admission, Ended, Ledger, Standing, Ticket
from hookline.dispatcher.backoff import Jitter, RetryPolicy, honoured_retry_after_s
from hookline.dispatcher.catchup import CaughtUp
from hookline.dispatcher.consumed import Incoming
from hookline.dispatcher.delays import Delays
from hookline.dispatcher.ordering import SubjectOrder
from hookline.dispatcher.outcome import Ack, DeadLetter, Retry, Settlement, classify, settle
from hookline.dispatcher.pacing import Pacer
from hookline.dispatcher.reporting import Telemetry
from hookline.dispatcher.settings import DispatcherSettings
from hookline.dispatcher.settled import Settled
from hookline.dispatcher.turns import Turns
from hookline.shared import __version__
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import BROKER_ERRORS, CALL_TIMEOUT_S, Publisher
from hookline.shared.broker.isolation import Isolation
from hookline.shared.contracts import addressing
from hookline.shared.contracts.control import BreakerCommand, BreakerState, BreakerView
from hookline.shared.contracts.deadletters import dead_letter_message
from hookline.shared.contracts.headers import Header
from hookline.shared.contracts.models import DeadLetterReason, Event, StoredEndpoint
from hookline.shared.contracts.telemetry import AttemptFields, Deferral, DeferralReason, Outcome, exchange
from hookline.shared.contracts.webhook import webhook_request
from hookline.shared.outbound import signing
from hookline.shared.outbound.credentials import Credentials
from hookline.shared.outbound.delivery import AttemptResult, DeliveryClient, ErrorKind
from hookline.shared.outbound.sealing import Sealer
from hookline.shared.outbound.transforms import Transformer, TransformFailedError
from hookline.shared.runtime.tracing import Tracing
from hookline.shared.state.registry import ChangeLog, EndpointRegistry

log = structlog.get_logger(__name__)

USER_AGENT = f"hookline/{__version__}"

# A handler that crashes hands its message back after this pause; the queue's delivery limit turns a
# message that keeps crashing it into a dead letter.
CRASH_PAUSE_S = 1.0
#: A message that arrives for an endpoint whose breaker is open is handed back after this pause (from a
#: lane: handed on to the endpoint's address after it, which is its queue of its own once the monitor's
#: isolation of it has arrived).
BREAKER_NACK_PAUSE_S = 1.0
#: A held endpoint's copy (in a holding lane, past the bound on queues of their own) waits out its open
#: breaker in the delay queues until its probe is due, and at least this long (half open, probed by
#: another copy or another replica): one queue write per wait, not one a second.
HELD_RECHECK_S = 5
#: A copy forwarded this many times without reaching a queue (it keeps coming back unroutable) is kept
#: as an ``unroutable`` dead letter instead.
MAX_FORWARDS = 3
#: A lane copy of an event that most likely reached its endpoint straight from ``events`` too waits this
#: long, so that the replica delivering from the endpoint's queue has settled the other by then.
SECOND_COPY_AFTER_S = 5
#: Headers of an upstream's message that a copy for one endpoint keeps (the trace context); hookline's
#: own are never taken from a message published to ``events``.
_TRACE_HEADERS = ("traceparent", "tracestate")
#: What the broker adds to a message, never carried over to a copy.
_BROKER_HEADERS = ("x-death", "x-delivery-count")
#: The attempt record's fields that its log line repeats (never the response: it may hold customer data).
_LOGGED_FIELDS = (
    "event_id", "endpoint_id", "tenant", "type", "attempt", "status", "outcome", "error", "duration_ms",
    "dns_ms", "connect_ms", "first_byte_ms", "dead_letter_reason",
)  # fmt: skip
#: A lane delivery whose turn has not come within this share of the slow line (0.1 s by default) tells of a
#: backlog; its endpoint is isolated if its waiting copies hold its lane (:func:`holds_its_lane`). Soon:
#: until then the burst passes through the lane, at three queue writes an event instead of one (a quarter
#: of the line let the first two seconds of a 10,000-event burst through, and its lane's neighbours p99
#: 2.6-4.5 s; a twentieth, p99 249-262 ms).
BACKLOG_WAIT_SHARE = 1 / 20
#: A delivery that must wait longer than this for its turn (rate limit, Retry-After) is deferred
#: through the delay queues instead of holding its message.
MAX_LOCAL_WAIT_S = 10.0
#: A delivery that waits this long for a connection slot (its endpoint is slow, and so are enough others
#: to fill their share) is put off by SLOW_SHARE_DEFER_S instead: far from the broker's consumer_timeout
#: (30 min by default), past which it would close the channel of every endpoint consumed on it.
MAX_SLOT_WAIT_S = 60.0
SLOW_SHARE_DEFER_S = 30.0


_SETTLED_AS = {Ack: "delivered", Retry: "retry_scheduled", DeadLetter: "dead_lettered"}


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


def holds_its_lane(waiting: int, lane_waiting: int, *, per_endpoint: int) -> bool:
    """Whether an endpoint whose lane deliveries waited too long for their turn is backlogged: its
    waiting copies are most of what waits here from its lane, so the lane messages they keep unacked
    hold the lane's window, and the other endpoints' events behind them in the broker wait for it (a
    burst). When a load is spread over a tenant's endpoints (or each event goes to all of them), each
    waits its share: nobody is behind anybody, and a queue of its own would only write each of their
    events twice, on a machine already short of time."""
    return waiting >= per_endpoint and 2 * waiting > lane_waiting


@dataclass(frozen=True, slots=True)
class _Keys:
    version: datetime  # the endpoint's updated_at they were made from
    keys: list[bytes]
    expires: datetime | None  # when the first of them stops signing


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
        self._settings = settings
        self._registry = change_log.registry
        self._change_log = change_log
        self._caught_up = CaughtUp(change_log)
        self._isolation = isolation
        # Deliveries from lanes under way per endpoint, and their turns (see _from_lane).
        self._lane_turns: dict[str, Turns] = {}
        self._lanes_waiting: Counter[str] = Counter()
        self._credentials = Credentials(sealer, client)
        self._tracing = tracing or Tracing("dispatcher", None)
        # Started at the first transform; the service owns (and stops) the one it passes.
        self._transformer = transformer or Transformer(max_bytes=settings.max_payload_bytes)
        self._publisher = publisher
        self._delays = Delays(publisher)
        self._random_unit = random_unit
        self._telemetry = telemetry
        self._breakers = breakers
        self._signing_keys: dict[str, _Keys] = {}
        self._policies: dict[str, tuple[datetime, RetryPolicy]] = {}  # per endpoint, with its version
        self._pacer = Pacer()
        self._settled = Settled()
        self._order = SubjectOrder(stale_s=settings.order_hold_s)
        self._sealer = sealer

    @property
    def registry(self) -> EndpointRegistry:
        return self._registry

    def from_lanes(self) -> dict[str, int]:
        """Deliveries from lanes under way, per endpoint (for heartbeats: what a delete waits for)."""
        return {endpoint_id: turns.users for endpoint_id, turns in self._lane_turns.items()}

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
            await self.gone(endpoint_id, message)
            return False
        if held:
            return await self._from_holding(endpoint, message, probe=probe)
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
                await self.hand_on(
                    message, endpoint, reason="isolated", headers=second, delay_s=SECOND_COPY_AFTER_S
                )
            else:
                await self.hand_on(message, endpoint, reason="isolated")
            return False
        if not probe and self._breakers.state(endpoint_id) is not None:
            # Delivered before the breaker opened reached us: back, not attempted. After a pause: until
            # its consumer is cancelled the queue hands it straight back, and every return counts toward
            # the delivery limit.
            if lane:
                await self.hand_on(
                    message, endpoint, delay_s=int(BREAKER_NACK_PAUSE_S), reason="breaker_open"
                )
            else:
                await asyncio.sleep(BREAKER_NACK_PAUSE_S)
                await self.acks.nack(message, requeue=True)
            return False
        if lane and not probe:
            return await self._from_lane(endpoint, message, parsed)
        return await self._handle(endpoint, message, parsed, probe=probe, lane=False)

    async def _from_lane(
        self, endpoint: StoredEndpoint, message: Incoming, parsed: decoding.Inbound | None
    ) -> bool:
        """A lane message's delivery: at most ``HOOKLINE_PREFETCH_PER_ENDPOINT`` of an endpoint's go at
        once here. One that waits for its turn longer than a twentieth of the slow line, for an endpoint
        whose waiting copies hold its lane (:func:`holds_its_lane`), means the endpoint is backlogged:
        it is isolated, so that a burst to it is moved off the lane at the rate of queue writes rather
        than of its answers."""
        turns = self._turns_of(endpoint.id, topology.lane_of(endpoint.tenant))
        try:
            if not await turns.enter(
                self._lane_limit(), timeout_s=self._settings.slow_attempt_s * BACKLOG_WAIT_SHARE
            ):
                if self._holds_its_lane(turns) and await self._isolate(endpoint, "backlogged"):
                    await self.hand_on(message, endpoint, reason="backlogged")
                    return False
                # Its lane's fair share, or no queue to be had: it waits for its turn.
                await turns.enter(self._lane_limit(), timeout_s=None)
            try:
                return await self._handle(endpoint, message, parsed, probe=False, lane=True)
            finally:
                turns.leave(self._lane_limit())
        finally:
            self._done_with(endpoint.id, turns)

    def _lane_limit(self) -> int:
        """An endpoint's deliveries from its lane under way at once: fewer while the event loop runs late,
        as the admission would start no more of them (admission.py)."""
        per_endpoint = self._settings.prefetch_per_endpoint
        return min(per_endpoint, CROWDED_IN_FLIGHT) if self.admission.ledger.crowded else per_endpoint

    def _turns_of(self, endpoint_id: str, lane: str) -> Turns:
        """The endpoint's turns for deliveries from ``lane`` (its lane, or its holding lane), shared by
        its deliveries under way here (each gives them back with :meth:`_done_with`)."""
        turns = self._lane_turns.get(endpoint_id)
        if turns is None:
            turns = self._lane_turns[endpoint_id] = Turns(lane, self._lanes_waiting)
        turns.users += 1
        return turns

    def _done_with(self, endpoint_id: str, turns: Turns) -> None:
        turns.users -= 1
        if not turns.users:  # dropped with the last of them
            turns.close()
            del self._lane_turns[endpoint_id]

    def _holds_its_lane(self, turns: Turns) -> bool:
        # This copy waits no more, yet it is one of the endpoint's: counted on both sides.
        return holds_its_lane(
            turns.waiting + 1,
            self._lanes_waiting[turns.lane] + 1,
            per_endpoint=self._settings.prefetch_per_endpoint,
        )

    async def _from_holding(self, endpoint: StoredEndpoint, message: Incoming, *, probe: bool) -> bool:
        """A copy in a holding lane: its endpoint is isolated past the bound on queues of their own, and
        shares the lane only with others like it. Its breaker open, the copy waits in the delay queues
        until the probe is due (no hand-back cycle); otherwise it goes out with the endpoint's whole
        timeout, at most ``HOOKLINE_PREFETCH_PER_ENDPOINT`` of an endpoint's at once here."""
        if not self._registry.placements.held(endpoint):
            await self.hand_on(message, endpoint, reason="moved")  # back in its lane, or a queue of its own
            return False
        breaker = self._breakers.state(endpoint.id)
        if breaker is not None and not probe:
            wait_s = held_wait_s(breaker, now_s=time.time())
            await self.hand_on(message, endpoint, delay_s=wait_s, reason="breaker_open")
            return False
        turns = self._turns_of(endpoint.id, topology.holding_of(endpoint.id))
        limit = self._settings.prefetch_per_endpoint
        try:
            if not await turns.enter(limit, timeout_s=MAX_SLOT_WAIT_S):
                # Far from the broker's consumer_timeout: put off, its turn not had within a minute.
                await self.hand_on(message, endpoint, delay_s=int(SLOW_SHARE_DEFER_S), reason="held_busy")
                return False
            try:
                return await self._handle(endpoint, message, None, probe=probe, lane=False)
            finally:
                turns.leave(limit)
        finally:
            self._done_with(endpoint.id, turns)

    async def parse_event(self, message: Incoming, *, tenant: str) -> decoding.Inbound | decoding.Invalid:
        """The event in a message for one of ``tenant``'s endpoints, checked (the catalog's schema too,
        on an event's first hop)."""
        parsed = decoding.parse(
            message.body,
            message_id=message.message_id,
            content_type=message.content_type,
            exchange=message.exchange,
            routing_key=message.routing_key,
            headers=message.headers,
            endpoint_tenant=tenant,
            max_bytes=self._settings.max_payload_bytes,
        )
        if not isinstance(parsed, decoding.Inbound) or message.exchange != topology.EVENTS_EXCHANGE:
            return parsed
        checked = self._catalog_check(parsed)
        if isinstance(checked, decoding.Inbound):
            return checked
        # Refused by this replica's view of the catalog, which may be behind: an operator relaxed the
        # schema, an ingest answered, and the upstream published at once. Read the log up to now first.
        try:
            await self._caught_up.wait(timeout_s=CALL_TIMEOUT_S)
        except BROKER_ERRORS as exc:  # refused by the view as it is: a dead letter, redrivable
            log.warning("catalog_sync_failed", event_id=parsed.event.id, error=type(exc).__name__)
            return checked
        return self._catalog_check(parsed)

    async def _handle(
        self,
        endpoint: StoredEndpoint,
        message: Incoming,
        parsed_before: decoding.Inbound | None,
        *,
        probe: bool,
        lane: bool,
    ) -> bool:
        parsed = parsed_before or await self.parse_event(message, tenant=endpoint.tenant)
        if isinstance(parsed, decoding.Invalid):
            await self._dead_letter(
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
        deferred = await self._gate(endpoint, parsed, sequence, probe=probe, lane=lane)
        if deferred is not None:
            await self._defer(message, endpoint, parsed, sequence, *deferred)
            return False
        ticket = await self._admitted(message, endpoint, parsed, sequence, probe=probe, lane=lane)
        if ticket is None:
            return False
        try:
            await self._attempt_and_settle(
                message, endpoint, parsed, sequence, ticket, probe=probe, lane=lane
            )
        except BaseException:
            if sequence is not None:  # never leave the subject blocked by an event that is not out
                assert event.subject is not None
                self._order.done(endpoint.id, event.subject, event.id)
            raise
        return True

    async def _admitted(
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
        ticket = await self.admission.acquire(endpoint.id, max_wait_s=max_wait_s)
        ledger = self.admission.ledger
        its_own = ledger.standing(endpoint.id) is Standing.SLOW or ledger.holds_more_than_its_share(
            endpoint.id
        )
        if ticket is None and lane and not its_own:
            # The slots are taken by other endpoints, or by many alike: this replica is busy, not this
            # endpoint slow or hogging them. Isolating it would only write its copy once more (at a
            # hundred thousand endpoints with one event each, a saturated receiver host made it twenty
            # thousand isolations at once).
            ticket = await self.admission.acquire(endpoint.id, max_wait_s=MAX_SLOT_WAIT_S - max_wait_s)
        if ticket is None:
            slow = ledger.standing(endpoint.id) is Standing.SLOW
            if lane and its_own and await self._isolate(endpoint, "slow" if slow else "backlogged"):
                await self.hand_on(message, endpoint, reason="no_slot")
            else:
                await self._defer(message, endpoint, parsed, sequence, SLOW_SHARE_DEFER_S, "slow_share")
            return None
        event = parsed.event
        if not probe and self._breakers.state(endpoint.id) is not None:
            # Back to the queue, unattempted (the consumer is cancelled by now: the queue keeps it for
            # the probe); from a lane, on to the endpoint's address.
            self.admission.release(ticket, Ended.NOT_SENT)
            if sequence is not None:  # back in the queue: still ahead of its subject's later events
                assert event.subject is not None
                self._order.retrying(endpoint.id, event.subject, event.id, due_s=time.time())
            if lane:
                await self.hand_on(
                    message, endpoint, delay_s=int(BREAKER_NACK_PAUSE_S), reason="breaker_open"
                )
            else:
                await self.acks.nack(message, requeue=True)
            return None
        paused_s = 0.0 if probe else self._pacer.paused_for_s(endpoint.id, now_s=time.time())
        if paused_s > 0:
            self.admission.release(ticket, Ended.NOT_SENT)
            await self._defer(message, endpoint, parsed, sequence, paused_s, "pacing")
            return None
        return ticket

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

    def _catalog_check(self, parsed: decoding.Inbound) -> decoding.Inbound | decoding.Invalid:
        """An event published straight to AMQP, on its first hop, by its type's schema in the catalog (the
        ingest checked those it took over HTTP, and retries were checked on their first hop)."""
        event = parsed.event
        violation = self._change_log.catalog.check(event.type, event.schema_version, event.data)
        if violation is None:
            return parsed
        if violation.validation == "enforce":
            return decoding.Invalid(
                f"does not match the schema of {event.type}: {violation.describe()}", event.id
            )
        log.warning("event_schema_mismatch", event_id=event.id, type=event.type, at=violation.pointers())
        return parsed

    async def _attempt_and_settle(
        self,
        message: Incoming,
        endpoint: StoredEndpoint,
        parsed: decoding.Inbound,
        sequence: int | None,
        ticket: Ticket,
        *,
        probe: bool,
        lane: bool = False,
    ) -> None:
        started_s = time.time()
        # From a lane, an attempt is cut at the slow line (unless the endpoint's own timeout is shorter):
        # the events behind it in the lane must not wait for a slow endpoint.
        deadline_s = self._settings.slow_attempt_s if lane else None
        cut = asyncio.timeout(deadline_s if deadline_s and deadline_s < endpoint.timeout_s else None)
        try:
            async with cut:
                result = await self._attempt(endpoint, parsed, message.body)
        except TimeoutError:
            if not cut.expired():
                self.admission.release(ticket, Ended.NOT_SENT)
                raise  # not the cut: a crash of the attempt's own
            self.admission.release(ticket, Ended.TIMED_OUT)  # slow here from now on
            await self._cut(message, endpoint, parsed)
            return
        except BaseException:
            self.admission.release(
                ticket, Ended.NOT_SENT
            )  # cancelled (shutdown), or a crash: it says nothing
            raise
        self.admission.release(
            ticket, Ended.TIMED_OUT if result.error is ErrorKind.TIMEOUT else Ended.ANSWERED
        )
        outcome = classify(result.status, result.error)
        first_attempt_at_s = parsed.first_attempt_at_s or started_s
        settlement = settle(
            outcome,
            status=result.status,
            attempt=parsed.attempt,
            first_attempt_at_s=first_attempt_at_s,
            now_s=time.time(),
            policy=self._policy(endpoint),
            random=self._random_unit(),
            retry_after=result.retry_after,
            now=datetime.now(UTC),
            error=result.error,
        )
        ended_s = time.time()
        metrics.attempts(outcome.value).inc()
        metrics.ATTEMPT_SECONDS.observe(result.timings.total_ms / 1000)
        # A 429's Retry-After also pauses the endpoint (a 503's delays this event only).
        pause_s = (
            honoured_retry_after_s(
                result.retry_after,
                status=result.status,
                now=datetime.now(UTC),
                cap_s=self._settings.retry_after_cap_s,
            )
            if result.status == 429
            else None
        )
        paused_until_s = self._pacer.record(
            endpoint.id, status=result.status, retry_after_s=pause_s, now_s=ended_s
        )
        self._report(
            endpoint, parsed, outcome, settlement, result, first_attempt_at_s, ended_s, paused_until_s,
            probe=probe,
        )  # fmt: skip
        await self._apply(settlement, message, endpoint, parsed, first_attempt_at_s, result, sequence)

    async def _cut(self, message: Incoming, endpoint: StoredEndpoint, parsed: decoding.Inbound) -> None:
        """An attempt from a lane that outlived the slow line: not the endpoint's failure (no attempt is
        counted), its copy handed to the endpoint's queue of its own, where it goes out again with the
        endpoint's whole timeout (the receiver may have had the request: at least once). Past the bound
        on queues of their own, put off instead."""
        event = parsed.event
        if self._registry.get(endpoint.id) is None:
            # Deleted while the attempt was under way: kept as a dead letter, like any copy of it left.
            await self.gone(endpoint.id, message)
            delay_s = 0
        elif await self._isolate(endpoint, "slow"):
            await self.hand_on(message, endpoint, reason="slow")
            delay_s = 0
        else:
            await self._delays.schedule(
                message.body, content_type=message.content_type, timestamp=message.timestamp,
                event_id=event.id, endpoint_id=endpoint.id, destination=self._registry.placements.address(endpoint),
                next_attempt=parsed.attempt, first_attempt_at_s=parsed.first_attempt_at_s or time.time(),
                delay_s=int(SLOW_SHARE_DEFER_S), sequence=None, trace=parsed.trace,
            )  # fmt: skip
            await self.acks.ack(message)
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

    async def _isolate(self, endpoint: StoredEndpoint, reason: str) -> bool:
        """Isolate the endpoint (shared/broker/isolation.py: a queue of its own, or held in a holding lane past
        the bound); whether it is isolated now."""
        if self._isolation is None:
            return False
        isolated = await self._isolation.isolate(endpoint, reason)
        metrics.ISOLATIONS.labels(reason if isolated else "refused").inc()
        return isolated

    async def hand_on(
        self,
        message: Incoming,
        endpoint: StoredEndpoint,
        *,
        reason: str,
        delay_s: int = 0,
        destination: str | None = None,
        headers: Mapping[str, object] | None = None,
    ) -> None:
        """The message, unattempted, to the endpoint's address (its queue of its own, or its lane; or
        ``destination``) after ``delay_s``, confirmed, then acked here: what it carried of hookline's own
        goes with it, and ``headers``. ``reason``: what the count of hand-offs says (isolated: its usual
        way there)."""
        copy = addressing.message(
            message.body,
            event_id=message.message_id or "",
            endpoint_id=endpoint.id,
            content_type=message.content_type,
            timestamp=message.timestamp,
            headers={**carried_headers(message), **(headers or {})},
        )
        await addressing.send(
            self._publisher,
            copy,
            destination=destination or self._registry.placements.address(endpoint),
            delay_s=delay_s,
        )
        await self.acks.ack(message)
        metrics.HANDED_ON.labels(reason).inc()

    def _report(
        self,
        endpoint: StoredEndpoint,
        parsed: decoding.Inbound,
        outcome: Outcome,
        settlement: Settlement,
        result: AttemptResult,
        first_attempt_at_s: float,
        ended_s: float,
        paused_until_s: float | None,
        *,
        probe: bool,
    ) -> None:
        """The attempt's telemetry record and its canonical log line (the record's fields, without the
        receiver's answer: it may hold a customer's data)."""
        event = parsed.event
        next_attempt_in_s = settlement.delay_s if isinstance(settlement, Retry) else None
        # As it goes on the wire (AttemptFields; the monitor and the ingest validate it as an
        # AttemptRecord): a model built here would cost the delivery path as much as the rest.
        record: AttemptFields = {
            "kind": "attempt",
            "at_s": ended_s,
            "dispatcher_id": self._telemetry.dispatcher_id,
            "event_id": event.id,
            "endpoint_id": endpoint.id,
            "tenant": event.tenant,
            "type": event.type,
            "attempt": parsed.attempt,
            "outcome": outcome.value,
            "first_attempt_at_s": first_attempt_at_s,
            "next_attempt_at_s": ended_s + next_attempt_in_s if next_attempt_in_s is not None else None,
            "dead_letter_reason": settlement.reason.value if isinstance(settlement, DeadLetter) else None,
            "probe": probe,
            "attempt_kind": "probe"
            if probe
            else "retry"
            if parsed.attempt > 1
            else parsed.origin or "delivery",
            **exchange(result, self._sealer),
        }
        self._telemetry.attempt(record)
        fields = cast("Mapping[str, object]", record)
        log.info(
            "delivery_attempt",
            **{name: fields[name] for name in _LOGGED_FIELDS},
            next_attempt_in_s=next_attempt_in_s,
            # A 429's pause of the whole endpoint: on the line only, not the telemetry record, which
            # the monitor and ingest of the version before would refuse whole (an unknown field).
            paused_until_s=paused_until_s,
            probe=probe or None,
        )

    async def _gate(
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

    async def _defer(
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
        await self.acks.ack(message)
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

    def _policy(self, endpoint: StoredEndpoint) -> RetryPolicy:
        cached = self._policies.get(endpoint.id)
        if cached is not None and cached[0] == endpoint.updated_at:
            return cached[1]
        settings = self._settings
        policy = RetryPolicy(
            schedule_s=tuple(endpoint.retry_schedule_s or settings.retry_schedule_s),
            retention_s=endpoint.retention_s or settings.retention_s,
            max_attempts=endpoint.max_attempts or settings.max_attempts,
            jitter=Jitter(settings.retry_jitter),
            retry_after_cap_s=settings.retry_after_cap_s,
        )
        self._policies[endpoint.id] = (endpoint.updated_at, policy)
        return policy

    async def _attempt(
        self, endpoint: StoredEndpoint, parsed: decoding.Inbound, body: bytes
    ) -> AttemptResult:
        event = parsed.event
        transformed = None
        if endpoint.transform is not None:  # the endpoint's version now: a PATCH changes later bodies
            try:
                transformed = await self._transformer.apply(endpoint.transform, body)
            except TransformFailedError as exc:
                return AttemptResult.failed(ErrorKind.TRANSFORM, str(exc))
        request = webhook_request(
            endpoint, self._keys(endpoint), event.id, body,
            timestamp_s=int(time.time()), sequence=event.sequence, transformed=transformed,
        )  # fmt: skip
        headers = request.headers
        attributes: dict[str, str | int | float] = {
            "hookline.event_id": event.id, "hookline.event_type": event.type, "hookline.endpoint_id": endpoint.id,
            "hookline.tenant": event.tenant, "hookline.attempt": parsed.attempt,
        }  # fmt: skip
        with self._tracing.span("hookline.deliver", parsed.trace, attributes, kind=SpanKind.CLIENT) as (
            trace,
            span,
        ):
            if trace is not None:
                headers.update(trace.headers())
            result = await self._credentials.post(endpoint, request.body, headers)
            if span is not None:
                span.set_attribute("http.response.status_code", result.status or 0)
                if result.error is not None:
                    span.set_attribute("error.type", result.error.value)
        return result

    def _keys(self, endpoint: StoredEndpoint) -> list[bytes]:
        """The keys of the secrets that sign now: the newest, and during a rotation the previous ones.

        Opened (and decoded) once per endpoint version, again when a rotated-out secret expires.
        """
        now = datetime.now(UTC)
        cached = self._signing_keys.get(endpoint.id)
        if (
            cached is None
            or cached.version != endpoint.updated_at
            or (cached.expires and now >= cached.expires)
        ):
            live = [s for s in endpoint.secrets if s.expires_at is None or s.expires_at > now]
            cached = _Keys(
                version=endpoint.updated_at,
                keys=[signing.secret_key(self._sealer.open(secret.value)) for secret in live],
                expires=min((s.expires_at for s in live if s.expires_at is not None), default=None),
            )
            self._signing_keys[endpoint.id] = cached
        return cached.keys

    async def _apply(
        self,
        settlement: Settlement,
        message: Incoming,
        endpoint: StoredEndpoint,
        parsed: decoding.Inbound,
        first_attempt_at_s: float,
        result: AttemptResult,
        sequence: int | None,
    ) -> None:
        event = parsed.event
        if isinstance(settlement, Retry):
            await self._delays.schedule(
                message.body,
                content_type=message.content_type,
                timestamp=message.timestamp,
                event_id=event.id,
                endpoint_id=endpoint.id,
                destination=self._registry.placements.address(endpoint),
                next_attempt=parsed.attempt + 1,
                first_attempt_at_s=first_attempt_at_s,
                delay_s=settlement.delay_s,
                sequence=sequence,
                trace=parsed.trace,
            )
        elif isinstance(settlement, DeadLetter):
            await self._dead_letter(
                message, endpoint.id, endpoint.tenant, settlement.reason,
                event_id=event.id, attempts=parsed.attempt, last_status=result.status, last_error=result.detail,
            )  # fmt: skip
            if settlement.disable:
                await self._disable(endpoint.id, status=result.status)
        else:
            assert isinstance(settlement, Ack)
        if parsed.origin is None:
            self._settled.add(
                (endpoint.id, event.id, parsed.attempt), _SETTLED_AS[type(settlement)], now_s=time.monotonic()
            )
        await self.acks.ack(message)
        if sequence is not None:
            assert event.subject is not None
            if isinstance(settlement, Retry):
                self._order.retrying(
                    endpoint.id, event.subject, event.id, due_s=time.time() + settlement.delay_s
                )
            else:
                self._order.done(endpoint.id, event.subject, event.id)

    async def _disable(self, endpoint_id: str, *, status: int | None) -> None:
        """A 410: the endpoint is gone, paused or not. Disabled, it holds its events in a queue of its own
        (declared first, whatever the bound: what a resume delivers must not be lost)."""
        try:
            endpoint = self._registry.get(endpoint_id)
            if endpoint is not None and self._isolation is not None:
                await self._isolation.ensure_queue(endpoint)
            written = await self._change_log.disable(
                endpoint_id, unless=frozenset(), timeout_s=self._settings.connect_timeout_s
            )
        except Exception as exc:
            # The dead letter is kept already; the message must be acked, not attempted again. The next
            # 410 disables the endpoint (or an operator does).
            log.error("endpoint_disable_failed", endpoint_id=endpoint_id, error=type(exc).__name__)
            return
        if written is not None:
            log.warning(
                "endpoint_disabled", endpoint_id=endpoint_id, tenant=written.tenant, status=status, alert=True
            )

    async def gone(self, endpoint_id: str, message: Incoming) -> None:
        """A message of an endpoint that was deleted: kept as an ``endpoint_gone`` dead letter."""
        gone = self._registry.deletions.last_known(endpoint_id)
        await self._dead_letter(
            message, endpoint_id, gone.tenant if gone else None, DeadLetterReason.ENDPOINT_GONE,
            event_id=message.message_id, attempts=0, last_status=None, last_error="the endpoint was deleted",
        )  # fmt: skip
        await self.acks.ack(message)

    async def forward(self, endpoint_id: str, message: Incoming) -> None:
        """A message in a queue the endpoint has left (a queue of an earlier generation, or of the
        version before lanes): to its address (confirmed), then acked."""
        endpoint = self._registry.get(endpoint_id)
        if endpoint is None:
            await self.gone(endpoint_id, message)
            return
        await self.hand_on(message, endpoint, reason="forwarded")

    async def handle_unroutable(self, message: Incoming) -> None:
        """A message addressed to a queue that was not there (removed once drained, or deleted by hand):
        forwarded to the endpoint's address as it is now, or dead-lettered when the endpoint is gone or
        the message keeps coming back."""
        destination = topology.delay_destination(message.routing_key or "")
        endpoint_id = addressing.endpoint_named(message.headers) or topology.endpoint_of(destination)
        endpoint = self._registry.get(endpoint_id) if endpoint_id else None
        if endpoint is None:
            await self.gone(endpoint_id or destination, message)
            return
        forwards = (message.headers or {}).get(Header.FORWARDS, 0)
        forwards = forwards if isinstance(forwards, int) else MAX_FORWARDS
        if forwards >= MAX_FORWARDS:
            await self._dead_letter(
                message, endpoint.id, endpoint.tenant, DeadLetterReason.UNROUTABLE,
                event_id=message.message_id, attempts=0, last_status=None,
                last_error=f"nothing bound for {destination} to take it, {forwards} times",
            )  # fmt: skip
            await self.acks.ack(message)
            return
        if (
            self._registry.placements.isolated(endpoint)
            and not self._registry.placements.held(endpoint)
            and self._isolation
        ):
            # Deleted by hand, or lost with a node: declared again once its consumers have been told.
            await asyncio.sleep(topology.REDECLARE_AFTER_S)
            await self._isolation.ensure_queue(endpoint)
        copy = addressing.message(
            message.body,
            event_id=message.message_id or "",
            endpoint_id=endpoint.id,
            content_type=message.content_type,
            timestamp=message.timestamp,
            headers={**carried_headers(message), Header.FORWARDS: forwards + 1},
        )
        await addressing.send(self._publisher, copy, destination=self._registry.placements.address(endpoint))
        await self.acks.ack(message)
        log.info(
            "message_forwarded", endpoint_id=endpoint.id, event_id=message.message_id, missing=destination
        )

    async def fence(self, message: Incoming, endpoint_id: str) -> None:
        """A fence an ingest put in an endpoint's lane has come out of it (:mod:`.fences`): every lane
        message published before the endpoint's deletion, or before its queue of its own was bound to
        ``events``, has been given out; the fan-out stops counting it. Taken before this replica knows
        of the change (it follows the change log a moment behind): put back in its lane for a second,
        never in the endpoint's queue of its own (a deleted one's is drained into dead letters once the
        deletion is known, so the fence would never pass and the fan-out count the endpoint for ever)."""
        endpoint = self._registry.get(endpoint_id)
        fence_id = message.message_id
        version = (message.headers or {}).get(Header.FENCE_VERSION)
        verdict = fences.verdict(
            endpoint,
            deleting=self._registry.deletions.deleting(endpoint_id),
            fence_id=fence_id,
            fence_version=version if isinstance(version, int) else None,
        )
        if verdict is fences.Verdict.DRAINED:
            await self._change_log.drained(endpoint_id, timeout_s=self._settings.connect_timeout_s)
        elif verdict is fences.Verdict.LEFT:
            await self._change_log.update(
                endpoint_id,
                partial(fences.left, fence_id=fence_id, at=datetime.now(UTC)),
                timeout_s=self._settings.connect_timeout_s,
            )
        elif verdict is fences.Verdict.EARLY:
            assert endpoint is not None
            lane = topology.lane_of(endpoint.tenant)
            await self.hand_on(message, endpoint, delay_s=1, reason="fence_early", destination=lane)
            return
        log.info("endpoint_fence_passed", endpoint_id=endpoint_id, verdict=verdict.value)
        await self.acks.ack(message)

    async def stray(self, message: Incoming) -> None:
        """A message in a lane that neither came from ``events`` nor names an endpoint (published there
        by hand): kept as an ``unroutable`` dead letter."""
        await self._dead_letter(
            message, "", None, DeadLetterReason.UNROUTABLE, event_id=message.message_id, attempts=0,
            last_status=None, last_error="a message in a lane for no endpoint (not from events)",
        )  # fmt: skip
        await self.acks.ack(message)

    async def dead_letter_invalid(
        self,
        message: Incoming,
        invalid: decoding.Invalid,
        *,
        tenant: str,
        endpoints: Sequence[StoredEndpoint],
    ) -> None:
        """What an upstream published to ``events`` is not an event: one ``invalid_event`` dead letter per
        endpoint it was meant for (one without an endpoint when it matches none), never dropped."""
        for endpoint_id in [endpoint.id for endpoint in endpoints] or [""]:
            await self._dead_letter(
                message, endpoint_id, tenant or None, DeadLetterReason.INVALID_EVENT,
                event_id=invalid.event_id, attempts=0, last_status=None, last_error=invalid.reason,
            )  # fmt: skip
            log.warning(
                "event_invalid", endpoint_id=endpoint_id or None, tenant=tenant, event_id=invalid.event_id,
                reason=invalid.reason,
            )  # fmt: skip

    async def dead_letter_part(
        self, message: Incoming, endpoint: StoredEndpoint, reason: DeadLetterReason, parsed: decoding.Inbound
    ) -> None:
        """One endpoint's copy of a lane message kept as a dead letter (the caller acks the message)."""
        await self._dead_letter(
            message, endpoint.id, endpoint.tenant, reason, event_id=parsed.event.id, attempts=0,
            last_status=None, last_error=f"the event's lane message was given out {reason.value} times",
        )  # fmt: skip

    async def _dead_letter(
        self,
        message: Incoming,
        endpoint_id: str,
        tenant: str | None,
        reason: DeadLetterReason,
        *,
        event_id: str | None,
        attempts: int,
        last_status: int | None,
        last_error: str,
    ) -> None:
        """Publish the dead letter and wait for the broker's confirm; the caller acks only after this."""
        await self._publisher.publish(
            dead_letter_message(
                message.body,
                reason=reason,
                endpoint_id=endpoint_id,
                tenant=tenant,
                event_id=event_id,
                attempts=attempts,
                last_status=last_status,
                last_error=last_error,
                now=datetime.now(UTC),
                content_type=message.content_type,
            ),
            exchange=topology.DEAD_LETTER_EXCHANGE,
            routing_key="",
        )
        metrics.DEAD_LETTERS.labels(reason.value).inc()


def held_wait_s(breaker: BreakerCommand, *, now_s: float) -> int:
    """How long a held endpoint's copy waits out its breaker: until the probe is due (when the monitor
    half-opens it), at least HELD_RECHECK_S (already due, or half open and probed with another copy)."""
    due_s = 0.0
    if breaker.state is BreakerState.OPEN and breaker.opened_at_s is not None:
        due_s = breaker.opened_at_s + breaker.cooldown_s - now_s
    return max(HELD_RECHECK_S, math.ceil(due_s))


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


def carried_headers(message: Incoming) -> dict[str, object]:
    """What a copy for one endpoint keeps of a message's headers: everything hookline put there but the
    broker's own additions; of an upstream's message (from ``events``), only the trace context."""
    headers = message.headers or {}
    if message.exchange == topology.EVENTS_EXCHANGE:
        return {key: headers[key] for key in _TRACE_HEADERS if key in headers}
    return {
        key: value
        for key, value in headers.items()
        if key not in _BROKER_HEADERS and not key.startswith("x-first-death")
    }
