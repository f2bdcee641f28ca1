"""Settling a message durably, then acking it: an attempt's settlement applied (a retry copy through
the delay queues, confirmed; a dead letter, confirmed; a 410's endpoint disabled), a message handed on
unattempted to its endpoint's address (confirmed), and the dead letters of messages that cannot be
delivered (the endpoint gone, not an event, a stray in a lane, a lane message given out too often).
Nothing is acked before its outcome is recorded somewhere durable.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

import structlog

from hookline.dispatcher import decoding, metrics
from hookline.dispatcher.acks import Acks
from hookline.dispatcher.consumed import Incoming
from hookline.dispatcher.delays import Delays
from hookline.dispatcher.ordering import SubjectOrder
from hookline.dispatcher.outcome import Ack, DeadLetter, Retry, Settlement
from hookline.dispatcher.settings import DispatcherSettings
from hookline.dispatcher.settled import Settled
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Publisher
from hookline.shared.broker.isolation import Isolation
from hookline.shared.contracts import addressing
from hookline.shared.contracts.deadletters import dead_letter_message
from hookline.shared.contracts.models import DeadLetterReason, StoredEndpoint
from hookline.shared.outbound.delivery import AttemptResult
from hookline.shared.state.registry import ChangeLog

log = structlog.get_logger(__name__)

#: Headers of an upstream's message that a copy for one endpoint keeps (the trace context); hookline's
#: own are never taken from a message published to ``events``.
_TRACE_HEADERS = ("traceparent", "tracestate")
#: What the broker adds to a message, never carried over to a copy.
_BROKER_HEADERS = ("x-death", "x-delivery-count")

_SETTLED_AS = {Ack: "delivered", Retry: "retry_scheduled", DeadLetter: "dead_lettered"}


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


class Settling:
    def __init__(
        self,
        settings: DispatcherSettings,
        change_log: ChangeLog,
        publisher: Publisher,
        delays: Delays,
        acks: Acks,
        settled: Settled,
        order: SubjectOrder,
        isolation: Isolation | None,
    ) -> None:
        self._settings = settings
        self._registry = change_log.registry
        self._change_log = change_log
        self._publisher = publisher
        self._delays = delays
        self._acks = acks
        self._settled = settled
        self._order = order
        self._isolation = isolation

    async def settle(
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
            await self.dead_letter(
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
        await self._acks.ack(message)
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
        await self._acks.ack(message)
        metrics.HANDED_ON.labels(reason).inc()

    async def isolate(self, endpoint: StoredEndpoint, reason: str) -> bool:
        """Isolate the endpoint (shared/broker/isolation.py: a queue of its own, or held in a holding lane past
        the bound); whether it is isolated now."""
        if self._isolation is None:
            return False
        isolated = await self._isolation.isolate(endpoint, reason)
        metrics.ISOLATIONS.labels(reason if isolated else "refused").inc()
        return isolated

    async def gone(self, endpoint_id: str, message: Incoming) -> None:
        """A message of an endpoint that was deleted: kept as an ``endpoint_gone`` dead letter."""
        gone = self._registry.deletions.last_known(endpoint_id)
        await self.dead_letter(
            message, endpoint_id, gone.tenant if gone else None, DeadLetterReason.ENDPOINT_GONE,
            event_id=message.message_id, attempts=0, last_status=None, last_error="the endpoint was deleted",
        )  # fmt: skip
        await self._acks.ack(message)

    async def stray(self, message: Incoming) -> None:
        """A message in a lane that neither came from ``events`` nor names an endpoint (published there
        by hand): kept as an ``unroutable`` dead letter."""
        await self.dead_letter(
            message, "", None, DeadLetterReason.UNROUTABLE, event_id=message.message_id, attempts=0,
            last_status=None, last_error="a message in a lane for no endpoint (not from events)",
        )  # fmt: skip
        await self._acks.ack(message)

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
            await self.dead_letter(
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
        await self.dead_letter(
            message, endpoint.id, endpoint.tenant, reason, event_id=parsed.event.id, attempts=0,
            last_status=None, last_error=f"the event's lane message was given out {reason.value} times",
        )  # fmt: skip

    async def dead_letter(
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
