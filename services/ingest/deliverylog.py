"""The delivery log: every event accepted and every attempt made, queryable by event, endpoint and time.

Two durable views (:class:`~hookline.shared.broker.views.RowView`, SQLite beside the ingest's other views):
the events, from the event log stream (``hookline.events.log``: id, tenant, type, subject, when, and
the offset to read the event back from), and the attempts, from the telemetry stream the dispatchers
already publish (one record per attempt, with timings and the start of the receiver's answer, sealed
when ``HOOKLINE_SECRET_KEY`` is set). Both keep ``HOOKLINE_DELIVERY_LOG_RETENTION_S``, and together
stay under ``HOOKLINE_DELIVERY_LOG_MAX_BYTES`` (the oldest rows go first); a view rebuilt from scratch
has what its stream still holds (the telemetry stream keeps 25 h).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import orjson
import structlog
from pydantic import ValidationError

from hookline.shared.broker import topology
from hookline.shared.broker.views import RowView, StreamMessage, ViewSchema
from hookline.shared.contracts.headers import Header
from hookline.shared.contracts.models import Model
from hookline.shared.contracts.telemetry import AttemptRecord, Deferral, Heartbeat, batch

log = structlog.get_logger(__name__)

DAY_S = 86_400
EVENTS_SCHEMA = ViewSchema(
    version=3,  # 2: the request digest of an event sent with an Idempotency-Key; 3: bytes per tenant and day
    statements=[
        """CREATE TABLE events (
            offset INTEGER PRIMARY KEY,
            event_id TEXT NOT NULL,
            tenant TEXT NOT NULL,
            type TEXT NOT NULL,
            subject TEXT,
            accepted_at_s REAL NOT NULL,
            request_digest TEXT,
            bytes INTEGER NOT NULL DEFAULT 0
        )""",
        "CREATE INDEX events_by_id ON events (event_id)",
        "CREATE INDEX events_by_tenant ON events (tenant, offset)",
        "CREATE INDEX events_by_time ON events (accepted_at_s)",
        # What each tenant published per UTC day (its bytes quota), whichever replica or upstream
        # accepted the events; kept by a trigger, so it outlives the rows that expire or are trimmed.
        """CREATE TABLE tenant_days (
            tenant TEXT NOT NULL,
            day INTEGER NOT NULL,
            events INTEGER NOT NULL,
            bytes INTEGER NOT NULL,
            PRIMARY KEY (tenant, day)
        )""",
        # 86400: DAY_S, the UTC day.
        """CREATE TRIGGER events_per_tenant_day AFTER INSERT ON events BEGIN
            INSERT INTO tenant_days VALUES (NEW.tenant, CAST(NEW.accepted_at_s / 86400 AS INTEGER), 1, NEW.bytes)
            ON CONFLICT (tenant, day) DO UPDATE SET events = events + 1, bytes = bytes + excluded.bytes;
        END""",
    ],
)
ATTEMPTS_SCHEMA = ViewSchema(
    version=2,  # 2: deferrals too (outcome "deferred")
    statements=[
        """CREATE TABLE attempts (
            id INTEGER PRIMARY KEY,
            event_id TEXT NOT NULL,
            endpoint_id TEXT NOT NULL,
            tenant TEXT NOT NULL,
            record BLOB NOT NULL,
            outcome TEXT NOT NULL,
            at_s REAL NOT NULL
        )""",
        "CREATE INDEX attempts_by_event ON attempts (event_id, id)",
        "CREATE INDEX attempts_by_endpoint ON attempts (endpoint_id, id)",
        "CREATE INDEX attempts_by_time ON attempts (at_s)",
    ],
)
DEFERRED = "deferred"  # the outcome column of a deferral: put back without an attempt
# Telemetry batches hold at most 500 records: an attempt's id is its batch's offset and its place in it.
_PER_BATCH = 1024
#: How HOOKLINE_DELIVERY_LOG_MAX_BYTES is shared: an event row is about a sixth of an attempt's, and
#: most events have an attempt or more.
_EVENTS_SHARE = 0.2
#: A trim goes this much below the budget, so that it does not run again at every pass.
_TRIM_HEADROOM = 0.05


class LoggedEvent(Model):
    offset: int  # in the event log: where its body is read back from
    event_id: str
    tenant: str
    type: str
    subject: str | None
    accepted_at_s: float


class Acceptance(Model):
    """When an event was first accepted, its type, and the digest of the request that sent it with a key."""

    type: str
    accepted_at_s: float
    request_digest: str | None


def _event_rows(offset: int, message: StreamMessage) -> list[tuple[Any, ...]]:
    try:
        body = orjson.loads(message.body)
    except orjson.JSONDecodeError:
        return []  # not an event: the dispatchers dead-letter it as invalid_event
    if not isinstance(body, dict) or not all(
        isinstance(body.get(key), str) for key in ("id", "tenant", "type")
    ):
        return []
    if not topology.published_as(message.routing_key, body):
        return []  # an upstream's event claiming another tenant: the dispatchers dead-letter it too
    headers = message.headers or {}
    accepted_ms = headers.get(Header.ACCEPTED_AT_MS)
    if isinstance(accepted_ms, int):
        accepted_at_s = accepted_ms / 1000
    elif message.timestamp is not None:
        accepted_at_s = message.timestamp.timestamp()
    else:
        accepted_at_s = time.time()
    subject = body.get("subject")
    digest = headers.get(Header.REQUEST_DIGEST)
    return [
        (
            offset,
            body["id"],
            body["tenant"],
            body["type"],
            subject if isinstance(subject, str) else None,
            accepted_at_s,
            digest if isinstance(digest, str) else None,
            len(message.body),
        )
    ]


def _attempt_rows(
    offset: int, message: StreamMessage, on_heartbeat: Callable[[Heartbeat], None]
) -> list[tuple[Any, ...]]:
    try:
        records = batch.validate_json(message.body)
    except ValidationError:
        log.warning("telemetry_unreadable", offset=offset)
        return []
    for record in records:
        if isinstance(record, Heartbeat):
            on_heartbeat(record)
    return [
        (
            offset * _PER_BATCH + index,
            record.event_id,
            record.endpoint_id,
            record.tenant,
            record.model_dump_json().encode(),
            record.outcome if isinstance(record, AttemptRecord) else DEFERRED,
            record.at_s,
        )
        for index, record in enumerate(records)
        if isinstance(record, AttemptRecord | Deferral)
    ]


class DeliveryLog:
    """The two views; open with ``async with``, follow each stream from its ``next_offset``."""

    def __init__(
        self,
        path: Path | None,
        *,
        vhost: str,
        retention_s: float,
        max_bytes: int = 10_000_000_000,
        on_heartbeat: Callable[[Heartbeat], None] = lambda _: None,
    ) -> None:
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self.events = RowView(
            path.with_suffix(".events.sqlite") if path else None,
            schema=EVENTS_SCHEMA,
            identity=f"{vhost}/{topology.EVENT_LOG}",
            # A record read twice (a consumer re-attached) is skipped before this: each is counted once.
            # IGNORE, not REPLACE: rows written again after a failed flush must not count twice in
            # tenant_days (its trigger fires on every insert).
            insert="INSERT OR IGNORE INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            derive=self._event_rows,
        )
        # The acceptance time of the newest event applied: what a quota check knows the view counts.
        self.latest_accepted_s = 0.0
        self.attempts = RowView(
            path.with_suffix(".attempts.sqlite") if path else None,
            schema=ATTEMPTS_SCHEMA,
            identity=f"{vhost}/{topology.TELEMETRY_LOG}",
            insert="INSERT OR REPLACE INTO attempts VALUES (?, ?, ?, ?, ?, ?, ?)",
            derive=partial(_attempt_rows, on_heartbeat=on_heartbeat),
        )

    def _event_rows(self, offset: int, message: StreamMessage) -> list[tuple[Any, ...]]:
        rows = _event_rows(offset, message)
        for row in rows:
            self.latest_accepted_s = max(self.latest_accepted_s, row[5])
        return rows

    async def __aenter__(self) -> Self:
        await self.events.__aenter__()
        try:
            await self.attempts.__aenter__()
        except BaseException:
            await self.events.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.attempts.__aexit__(exc_type, exc, tb)
        finally:
            await self.events.__aexit__(exc_type, exc, tb)

    # --- queries -------------------------------------------------------------------------------------

    async def event(self, event_id: str) -> LoggedEvent | None:
        def query(db: sqlite3.Connection) -> tuple[Any, ...] | None:
            row: tuple[Any, ...] | None = db.execute(
                "SELECT * FROM events WHERE event_id = ? ORDER BY offset DESC LIMIT 1", (event_id,)
            ).fetchone()
            return row

        row = await self.events.read(query)
        return None if row is None else _logged_event(row)

    async def accepted(self, tenant: str, event_id: str, *, since_s: float) -> Acceptance | None:
        """The first acceptance of this event since ``since_s``, if the log has seen one."""
        sql = (
            "SELECT type, accepted_at_s, request_digest FROM events"
            " WHERE event_id = ? AND tenant = ? AND accepted_at_s >= ? ORDER BY offset LIMIT 1"
        )
        row = await self.events.read(lambda db: db.execute(sql, (event_id, tenant, since_s)).fetchone())
        return None if row is None else Acceptance(type=row[0], accepted_at_s=row[1], request_digest=row[2])

    async def day_of(self, tenant: str, *, day_start_s: float) -> tuple[int, int]:
        """The events and event bytes ``tenant`` published on the UTC day starting at ``day_start_s``."""
        sql = "SELECT events, bytes FROM tenant_days WHERE tenant = ? AND day = ?"
        day = int(day_start_s // DAY_S)
        row = await self.events.read(lambda db: db.execute(sql, (tenant, day)).fetchone())
        return (int(row[0]), int(row[1])) if row is not None else (0, 0)

    async def recent_events(
        self,
        *,
        tenant: str | None,
        type: str | None,
        subject: str | None,
        since_s: float | None,
        until_s: float | None,
        before_offset: int | None,
        limit: int,
    ) -> list[LoggedEvent]:
        """Newest first; ``before_offset`` continues a page (the last offset of the previous one)."""
        clauses, parameters = _where(
            ("tenant = ?", tenant), ("type = ?", type), ("subject = ?", subject),
            ("accepted_at_s >= ?", since_s), ("accepted_at_s < ?", until_s), ("offset < ?", before_offset),
        )  # fmt: skip
        sql = f"SELECT * FROM events {clauses} ORDER BY offset DESC LIMIT ?"  # noqa: S608 - fixed clauses
        rows = await self.events.read(lambda db: db.execute(sql, (*parameters, limit)).fetchall())
        return [_logged_event(row) for row in rows]

    async def events_after(self, tenant: str, *, after_offset: int, limit: int) -> list[LoggedEvent]:
        """The tenant's events after ``after_offset`` in the event log, oldest first (a polling
        endpoint's next page)."""
        sql = "SELECT * FROM events WHERE tenant = ? AND offset > ? ORDER BY offset LIMIT ?"
        rows = await self.events.read(lambda db: db.execute(sql, (tenant, after_offset, limit)).fetchall())
        return [_logged_event(row) for row in rows]

    async def attempts_of_event(self, event_id: str) -> list[AttemptRecord]:
        sql = "SELECT record FROM attempts WHERE event_id = ? AND outcome != ? ORDER BY id"
        rows = await self.attempts.read(lambda db: db.execute(sql, (event_id, DEFERRED)).fetchall())
        return [AttemptRecord.model_validate_json(row[0]) for row in rows]

    async def deferrals_of_event(self, event_id: str) -> list[Deferral]:
        """The times the event was put back without an attempt (not its turn yet), oldest first."""
        sql = "SELECT record FROM attempts WHERE event_id = ? AND outcome = ? ORDER BY id"
        rows = await self.attempts.read(lambda db: db.execute(sql, (event_id, DEFERRED)).fetchall())
        return [Deferral.model_validate_json(row[0]) for row in rows]

    async def attempts_of_endpoint(
        self,
        endpoint_id: str,
        *,
        outcome: str | None,
        since_s: float | None,
        before_id: int | None,
        limit: int,
    ) -> list[tuple[int, AttemptRecord]]:
        """Newest first, each with the id that continues a page after it."""
        clauses, parameters = _where(
            ("endpoint_id = ?", endpoint_id),
            ("outcome != ?", DEFERRED),
            ("outcome = ?", outcome),
            ("at_s >= ?", since_s),
            ("id < ?", before_id),
        )
        sql = f"SELECT id, record FROM attempts {clauses} ORDER BY id DESC LIMIT ?"  # noqa: S608 - fixed clauses
        rows = await self.attempts.read(lambda db: db.execute(sql, (*parameters, limit)).fetchall())
        return [(row[0], AttemptRecord.model_validate_json(row[1])) for row in rows]

    async def expire(self, *, now_s: float) -> int:
        """Forget what is older than the retention, then the oldest rows past the size budget; how many
        rows went."""
        cutoff_s = now_s - self.retention_s
        events = await self.events.store.write(
            lambda db: db.execute("DELETE FROM events WHERE accepted_at_s < ?", (cutoff_s,)).rowcount
        )
        await self.events.store.write(
            lambda db: db.execute("DELETE FROM tenant_days WHERE day < ?", (int(cutoff_s // DAY_S),))
        )
        attempts = await self.attempts.store.write(
            lambda db: db.execute("DELETE FROM attempts WHERE at_s < ?", (cutoff_s,)).rowcount
        )
        events += await self.events.store.write(
            lambda db: _trim(db, "events", "offset", int(self.max_bytes * _EVENTS_SHARE))
        )
        attempts += await self.attempts.store.write(
            lambda db: _trim(db, "attempts", "id", int(self.max_bytes * (1 - _EVENTS_SHARE)))
        )
        return int(events) + int(attempts)

    async def used_bytes(self) -> int:
        """What the rows take in both files (pages freed by deletions are reused, not counted)."""
        return await self.events.read(_used_bytes) + await self.attempts.read(_used_bytes)


def _used_bytes(db: sqlite3.Connection) -> int:
    page_size, pages, free = (
        db.execute(f"PRAGMA {name}").fetchone()[0] for name in ("page_size", "page_count", "freelist_count")
    )
    return int((pages - free) * page_size)


def _trim(db: sqlite3.Connection, table: str, key: str, budget_bytes: int) -> int:
    """Delete the oldest rows of ``table`` (by ``key``) until its file's pages in use fit the budget."""
    used = _used_bytes(db)
    if used <= budget_bytes:
        return 0
    rows = int(db.execute(f"SELECT count(*) FROM {table}").fetchone()[0])  # noqa: S608 - fixed names
    excess = int(rows * (used - budget_bytes * (1 - _TRIM_HEADROOM)) / used) + 1
    sql = f"DELETE FROM {table} WHERE {key} IN (SELECT {key} FROM {table} ORDER BY {key} LIMIT ?)"  # noqa: S608
    removed = int(db.execute(sql, (excess,)).rowcount)
    log.warning("delivery_log_trimmed", table=table, rows=removed, used_bytes=used, budget_bytes=budget_bytes)
    return removed


def _where(*conditions: tuple[str, Any]) -> tuple[str, list[Any]]:
    """A WHERE clause of the conditions whose value is given (not None), and its parameters."""
    used = [(clause, value) for clause, value in conditions if value is not None]
    if not used:
        return "", []
    return "WHERE " + " AND ".join(clause for clause, _ in used), [value for _, value in used]


def _logged_event(row: Sequence[Any]) -> LoggedEvent:
    offset, event_id, tenant, type_, subject, accepted_at_s = row[:6]
    return LoggedEvent(
        offset=offset,
        event_id=event_id,
        tenant=tenant,
        type=type_,
        subject=subject,
        accepted_at_s=accepted_at_s,
    )
