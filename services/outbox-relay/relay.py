"""The relay's loops: claim rows, publish them with confirms, mark them sent; wake on NOTIFY; watch the
lag and delete sent rows after their retention.

At least once, never lost: a batch's rows stay locked (``FOR UPDATE SKIP LOCKED``) in one transaction
from the claim until they are marked sent, and they are marked only after RabbitMQ confirmed them. A
relay that dies anywhere in between leaves its transaction to roll back: the rows are claimed again and
published again (a duplicate with the same event id, which receivers drop by ``webhook-id``). Replicas
share the work: each skips the rows another holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from hookline.outbox_relay import metrics, schema
from hookline.outbox_relay.rows import (
    OrderKey,
    OutboxRow,
    Ready,
    Refused,
    SubjectKey,
    held_back,
    order_key,
    prepare,
    publish_order,
)
from hookline.outbox_relay.settings import OutboxRelaySettings
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import BROKER_ERRORS, CALL_TIMEOUT_S, Publisher
from hookline.shared.contracts.envelope import event_message
from hookline.shared.runtime import tracing
from hookline.shared.runtime.supervision import Loop

log = structlog.get_logger(__name__)

#: Rows held back wait for another relay's batch, which commits within a confirm round or so.
HELD_BACK_PAUSE_S = 0.05
#: How often the lag is read and sent rows past their retention are deleted.
WATCH_INTERVAL_S = 5.0
RETENTION_EVERY_S = 60.0
_DELETE_CHUNK = 10_000  # as in _DELETE_EXPIRED

_CLAIM = """
    SELECT position, id, tenant, type, subject, sequence, schema_version, data::text, occurred_at,
           traceparent, created_at
    FROM hookline_outbox
    WHERE sent_at IS NULL AND error IS NULL
    ORDER BY position
    LIMIT %s
    FOR UPDATE SKIP LOCKED
"""
# The earliest unsent row of each of these subjects that this batch does not hold (its order as in
# rows.order_key: numbered rows by sequence first).
_FIRST_ELSEWHERE = """
    SELECT DISTINCT ON (o.tenant, o.subject) o.tenant, o.subject, o.sequence, o.position
    FROM hookline_outbox o
    JOIN unnest(%s::text[], %s::text[]) AS s(tenant, subject) ON o.tenant = s.tenant AND o.subject = s.subject
    WHERE o.sent_at IS NULL AND o.error IS NULL AND NOT (o.position = ANY(%s::bigint[]))
    ORDER BY o.tenant, o.subject, o.sequence ASC NULLS LAST, o.position
"""
_MARK_SENT = "UPDATE hookline_outbox SET sent_at = clock_timestamp() WHERE position = ANY(%s::bigint[])"
_DELETE_SENT_NOW = "DELETE FROM hookline_outbox WHERE position = ANY(%s::bigint[])"
_REFUSE = "UPDATE hookline_outbox SET error = %s WHERE position = %s"
_LAG = """
    SELECT extract(epoch FROM clock_timestamp() - created_at)::float8
    FROM hookline_outbox WHERE sent_at IS NULL AND error IS NULL ORDER BY position LIMIT 1
"""
# Counted up to a bound: a count of a huge backlog would cost more than it tells.
_COUNTS = """
    SELECT (SELECT count(*) FROM (SELECT 1 FROM hookline_outbox WHERE sent_at IS NULL AND error IS NULL
                                  LIMIT 1000000) pending),
           (SELECT count(*) FROM (SELECT 1 FROM hookline_outbox WHERE sent_at IS NULL AND error IS NOT NULL
                                  LIMIT 1000000) failed)
"""
_DELETE_EXPIRED = """
    DELETE FROM hookline_outbox WHERE position IN (
        SELECT position FROM hookline_outbox
        WHERE sent_at < clock_timestamp() - make_interval(secs => %s)
        LIMIT 10000 FOR UPDATE SKIP LOCKED)
"""


class PublishFailedError(ConnectionError):
    """Some rows of a batch were not confirmed; those that were are marked sent, the others wait."""


@dataclass(frozen=True, slots=True)
class Pass:
    claimed: int
    published: int
    waiting: int


class Relay:
    def __init__(self, settings: OutboxRelaySettings, dsn: str, publisher: Publisher) -> None:
        self._settings = settings
        self._dsn = dsn
        self._publisher = publisher
        self._wake = asyncio.Event()
        self._lagging = False
        self._stopping = False
        self._between_batches = asyncio.Event()
        self._between_batches.set()

    async def connect(self, *, autocommit: bool = False) -> schema.Connection:
        return await schema.connect(self._dsn, autocommit=autocommit)

    # --- publishing ---------------------------------------------------------------------------------

    async def relay(self, loop: Loop) -> None:
        """Publish batches while there are rows; otherwise wait for a NOTIFY (or the poll interval)."""
        async with await self.connect() as conn:
            await schema.check(conn)
            loop.mark_up()
            while True:
                if self._stopping:
                    await asyncio.Future()  # parked until the shutdown cancels the loop
                self._wake.clear()  # a NOTIFY from now on means rows this pass may not have seen
                self._between_batches.clear()
                try:
                    done = await self.publish_batch(conn)
                finally:
                    self._between_batches.set()
                loop.beat()
                if done.claimed == self._settings.outbox_batch_size and done.published:
                    continue  # more are likely waiting
                pause_s = HELD_BACK_PAUSE_S if done.waiting else self._settings.outbox_poll_s
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause_s):
                        await self._wake.wait()

    async def finish_batch(self, timeout_s: float) -> None:
        """Shutdown: start no batch, and let the one in flight commit (cancelled, it would roll back and
        its rows go out twice)."""
        self._stopping = True
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._between_batches.wait()

    async def publish_batch(self, conn: schema.Connection) -> Pass:
        """One batch, in one transaction: claim, publish what may go, mark it sent, commit."""
        started_s = time.perf_counter()
        failure: BaseException | None = None
        async with conn.transaction():
            cursor = await conn.execute(_CLAIM, (self._settings.outbox_batch_size,))
            claimed = [OutboxRow(*row) for row in await cursor.fetchall()]
            if not claimed:
                return Pass(0, 0, 0)
            prepared = [prepare(row, max_bytes=self._settings.max_payload_bytes) for row in claimed]
            await self._refuse(conn, [p for p in prepared if isinstance(p, Refused)])
            ready = [p for p in prepared if isinstance(p, Ready)]
            first_elsewhere = await self._first_elsewhere(conn, claimed)
            going_rows, waiting = held_back([p.row for p in ready], first_elsewhere)
            going_positions = {row.position for row in going_rows}
            going = publish_order([p for p in ready if p.row.position in going_positions])
            confirmed, failure = await self._publish(going)
            if confirmed:
                done = _DELETE_SENT_NOW if self._settings.outbox_retention_s == 0 else _MARK_SENT
                await conn.execute(done, (confirmed,))
        # Committed: only now are the confirmed rows sent for good.
        metrics.PUBLISHED.inc(len(confirmed))
        metrics.HELD_BACK.inc(len(waiting))
        metrics.BATCH_SECONDS.observe(time.perf_counter() - started_s)
        if failure is not None:
            raise PublishFailedError(
                f"{len(going) - len(confirmed)} of {len(going)} rows not confirmed "
                f"({type(failure).__name__}); they are published again"
            ) from failure
        return Pass(len(claimed), len(confirmed), len(waiting))

    async def _refuse(self, conn: schema.Connection, refused: Sequence[Refused]) -> None:
        for item in refused:
            await conn.execute(_REFUSE, (item.reason, item.row.position))
            log.error(
                "outbox_row_refused", position=item.row.position, event_id=item.row.id,
                tenant=item.row.tenant, reason=item.reason,
            )  # fmt: skip
        metrics.REFUSED.inc(len(refused))

    async def _first_elsewhere(
        self, conn: schema.Connection, claimed: Sequence[OutboxRow]
    ) -> dict[SubjectKey, OrderKey]:
        subjects = sorted({key for row in claimed if (key := row.subject_key) is not None})
        if not subjects:
            return {}
        cursor = await conn.execute(
            _FIRST_ELSEWHERE,
            ([t for t, _ in subjects], [s for _, s in subjects], [row.position for row in claimed]),
        )
        return {
            (tenant, subject): order_key(sequence, position)
            for tenant, subject, sequence, position in await cursor.fetchall()
        }

    async def _publish(self, going: Sequence[Ready]) -> tuple[list[int], BaseException | None]:
        """Publish with confirms; the positions confirmed, and the first failure.

        All on one channel, so the broker routes them in the order given. The first goes alone: it
        opens the channel if need be, after which the others are written in the order they are started.
        """
        if not going:
            return [], None
        try:
            await self._send(going[0])
        except Exception as exc:
            return [], exc
        results = await asyncio.gather(*(self._send(ready) for ready in going[1:]), return_exceptions=True)
        confirmed = [going[0].row.position]
        confirmed += [
            ready.row.position for ready, result in zip(going[1:], results, strict=True) if result is None
        ]
        failures = [result for result in results if isinstance(result, BaseException)]
        return confirmed, failures[0] if failures else None

    async def _send(self, ready: Ready) -> None:
        row = ready.row
        trace = tracing.from_headers({tracing.TRACEPARENT: row.traceparent}) if row.traceparent else None
        await self._publisher.publish(
            # Accepted when the business transaction wrote it: the delivery log's latency includes the
            # time in the outbox.
            event_message(ready.event, ready.body, accepted_at=row.created_at, trace=trace),
            exchange=topology.EVENTS_EXCHANGE,
            routing_key=topology.event_routing_key(row.tenant, row.type),
        )

    # --- waking -------------------------------------------------------------------------------------

    async def listen(self, loop: Loop) -> None:
        """Wake the relay loop whenever a transaction that inserted rows commits."""
        async with await self.connect(autocommit=True) as conn:
            await conn.execute("LISTEN hookline_outbox")  # the insert trigger NOTIFYs it (migrations/)
            loop.mark_up()
            self._wake.set()  # rows inserted while nobody listened
            async for _ in conn.notifies():
                self._wake.set()

    # --- watching -----------------------------------------------------------------------------------

    async def watch(self, loop: Loop) -> None:
        """The lag, pending and failed counts for /metrics and the lag alert; the retention."""
        async with await self.connect(autocommit=True) as conn:
            loop.mark_up()
            next_retention_s = 0.0
            while True:
                await self._reconnect_broker()
                await self._measure(conn)
                if time.monotonic() >= next_retention_s:
                    await self._expire(conn)
                    next_retention_s = time.monotonic() + RETENTION_EVERY_S
                loop.beat()
                await asyncio.sleep(WATCH_INTERVAL_S)

    async def _reconnect_broker(self) -> None:
        """An idle relay publishes nothing that would bring a lost broker connection back (and /readyz
        with it): open it here."""
        with contextlib.suppress(*BROKER_ERRORS):
            async with asyncio.timeout(CALL_TIMEOUT_S):
                await self._publisher.open(topology.EVENTS_EXCHANGE)

    async def _measure(self, conn: schema.Connection) -> None:
        row = await (await conn.execute(_LAG)).fetchone()
        lag_s = float(row[0]) if row else 0.0
        counts = await (await conn.execute(_COUNTS)).fetchone()
        pending, failed = counts if counts else (0, 0)
        if pending:
            # Rows another transaction held when they were last claimed (a relay that died, a lock) are
            # not announced again: look for them now rather than at the next poll.
            self._wake.set()
        metrics.LAG_SECONDS.set(lag_s)
        metrics.PENDING_ROWS.set(pending)
        metrics.FAILED_ROWS.set(failed)
        lagging = lag_s > self._settings.outbox_lag_alert_s
        if lagging and not self._lagging:
            log.error(
                "outbox_lagging", lag_s=round(lag_s, 1), pending=pending,
                threshold_s=self._settings.outbox_lag_alert_s, alert=True,
            )  # fmt: skip
        elif self._lagging and not lagging:
            log.warning("outbox_caught_up", lag_s=round(lag_s, 1), pending=pending)
        self._lagging = lagging

    async def _expire(self, conn: schema.Connection) -> None:
        if self._settings.outbox_retention_s == 0:
            return
        while True:
            cursor = await conn.execute(_DELETE_EXPIRED, (self._settings.outbox_retention_s,))
            metrics.DELETED.inc(cursor.rowcount)
            if cursor.rowcount < _DELETE_CHUNK:
                return
