"""Telemetry from this dispatcher: attempt records batched, plus a heartbeat, off the delivery path.

Records are buffered and published every ``FLUSH_INTERVAL_S`` (or at ``MAX_BATCH``) as one message,
without publisher confirms: the delivery path never waits for telemetry. A batch that cannot be
published (broker gone, or refusing publishes during an alarm) is dropped and counted; the monitor
tolerates gaps.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import aio_pika
import orjson
import structlog

from hookline.dispatcher import metrics
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import BrokerBlockedError, Publisher
from hookline.shared.contracts.telemetry import AttemptFields, Deferral, Heartbeat
from hookline.shared.runtime.supervision import Loop

log = structlog.get_logger(__name__)

#: A record as it goes on the wire: an attempt built on the delivery path, or a model dumped.
_Wire = AttemptFields | dict[str, Any]

FLUSH_INTERVAL_S = 0.25
MAX_BATCH = 500
HEARTBEAT_INTERVAL_S = 5.0


class Telemetry:
    def __init__(self, publisher: Publisher, dispatcher_id: str) -> None:
        self._publisher = publisher
        self.dispatcher_id = dispatcher_id
        # () -> (in flight, consumers, unacked per endpoint), for heartbeats: what the consumers report,
        # once they exist (they are built after the handler, which reports here).
        # What a heartbeat says of the consumers: in_flight, consumers, unacked, probing (Heartbeat).
        self.load: Callable[[], dict[str, Any]] = dict
        # Records as they go on the wire (dicts): attempts are built so on the delivery path.
        self._buffer: list[_Wire] = []
        # Deferrals go in batches of their own: a monitor or ingest of an earlier version, which does
        # not know the record, then drops only those batches, never attempts.
        self._deferrals: list[_Wire] = []
        self._full = asyncio.Event()
        self._heartbeat_now = False
        self.applied_offset: Callable[[], int | None] = lambda: None
        self._applied_told: int | None = None
        self.stopping = False

    def applied(self) -> None:
        """The change log moved on here: a heartbeat goes out at once, saying how far (see Heartbeat)."""
        if self.applied_offset() != self._applied_told:
            self._heartbeat_now = True
            self._full.set()

    def attempt(self, record: AttemptFields) -> None:
        self._buffer.append(record)
        if len(self._buffer) >= MAX_BATCH:
            self._full.set()

    def deferral(self, record: Deferral) -> None:
        self._deferrals.append(record.model_dump(mode="json"))
        if len(self._deferrals) >= MAX_BATCH:
            self._full.set()

    async def run(self, loop: Loop) -> None:
        """Flush periodically and send heartbeats until cancelled (then flush what is left)."""
        next_heartbeat_s = 0.0
        loop.mark_up()
        try:
            while True:
                loop.beat()
                if self._heartbeat_now or time.monotonic() >= next_heartbeat_s:
                    self._heartbeat()
                    next_heartbeat_s = time.monotonic() + HEARTBEAT_INTERVAL_S
                await self.flush()
                self._full.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), FLUSH_INTERVAL_S)
        finally:
            if self.stopping:
                self._heartbeat()
            await self.flush()

    def _heartbeat(self) -> None:
        self._heartbeat_now = False
        self._applied_told = self.applied_offset()
        load = {"in_flight": 0, "consumers": 0, **self.load()}
        beat = Heartbeat(
            at_s=time.time(),
            dispatcher_id=self.dispatcher_id,
            applied_offset=self._applied_told,
            stopping=self.stopping,
            **load,
        )
        self._buffer.append(beat.model_dump(mode="json"))

    async def flush(self) -> None:
        await self._send(self._take(deferrals=False))
        await self._send(self._take(deferrals=True))

    def _take(self, *, deferrals: bool) -> list[_Wire]:
        if deferrals:
            records, self._deferrals = self._deferrals, []
        else:
            records, self._buffer = self._buffer, []
        return records

    async def _send(self, records: list[_Wire]) -> None:
        if not records:
            return
        try:
            await self._publisher.publish(
                aio_pika.Message(orjson.dumps(records), content_type="application/json"),
                exchange=topology.TELEMETRY_EXCHANGE,
                routing_key="",
            )
        except Exception as exc:  # whatever the broker did, the delivery path must not notice
            metrics.TELEMETRY_DROPPED.inc(len(records))
            if not isinstance(exc, BrokerBlockedError):  # an alarm has its own log line (broker_blocked)
                log.warning("telemetry_dropped", records=len(records), error=type(exc).__name__)
