"""Scheduling the next attempt: a copy of the message through the TTL delay hierarchy to its endpoint's
address (:mod:`hookline.shared.contracts.addressing`), confirmed.

The copy is a fresh message: our own headers travel (attempt, first attempt time, the trace context), the broker's
``x-death`` does not — RabbitMQ 3.x would take a second pass through a level queue for a cycle and
hold the message for ever.
"""

from __future__ import annotations

from datetime import datetime

from hookline.shared.broker.amqp import Publisher
from hookline.shared.contracts import addressing
from hookline.shared.contracts.headers import Header
from hookline.shared.runtime.tracing import TraceContext


class Delays:
    def __init__(self, publisher: Publisher) -> None:
        self._publisher = publisher

    async def schedule(
        self,
        body: bytes,
        *,
        content_type: str | None,
        timestamp: datetime | None,
        event_id: str,
        endpoint_id: str,
        destination: str,
        next_attempt: int,
        first_attempt_at_s: float,
        delay_s: int,
        sequence: int | None = None,
        trace: TraceContext | None = None,
    ) -> None:
        """Publish the retry copy and wait for the broker's confirm; the caller acks the original after."""
        copy = addressing.message(
            body,
            event_id=event_id,
            endpoint_id=endpoint_id,
            content_type=content_type,
            timestamp=timestamp,
            headers={
                Header.ATTEMPT: next_attempt,
                Header.FIRST_ATTEMPT_AT: int(first_attempt_at_s),
                **({Header.SEQUENCE: sequence} if sequence is not None else {}),
                **(trace.headers() if trace is not None else {}),
            },
        )
        await addressing.send(self._publisher, copy, destination=destination, delay_s=delay_s)
