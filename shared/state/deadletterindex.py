"""The dead letters not yet redriven, as a view of the stream ``hookline.dead-letters`` kept in a local
SQLite file (see :mod:`hookline.shared.broker.views`), so its memory does not grow with the dead
letters and a restart resumes from the last offset it applied. The ingest lists and redrives from it,
the monitor analyses it; the record's format is :mod:`hookline.shared.contracts.deadletters`.
"""

import asyncio
import sqlite3
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from itertools import groupby
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import orjson
import structlog

from hookline.shared.broker.topology import DEAD_LETTER_STREAM
from hookline.shared.broker.views import Applied, Offset, StreamMessage, ViewSchema, ViewStore
from hookline.shared.contracts.deadletters import (
    REDRIVEN_HEADER,
    DeadLetterAnalysis,
    DeadLetterItem,
    item_id,
    offset_of,
    read_item,
)
from hookline.shared.contracts.models import DeadLetterReason

log = structlog.get_logger(__name__)

#: Raise the version whenever the columns change or read_item derives them differently: every view
#: file of another version is then rebuilt from the stream.
SCHEMA = ViewSchema(
    version=2,
    statements=(
        """
        CREATE TABLE dead_letters (
            stream_offset INTEGER PRIMARY KEY,
            event_id TEXT,
            endpoint_id TEXT,
            tenant TEXT,
            type TEXT,
            reason TEXT NOT NULL,
            attempts INTEGER NOT NULL,
            last_status INTEGER,
            last_error TEXT NOT NULL,
            dead_at_us INTEGER NOT NULL  -- microseconds since the Unix epoch
        )
        """,
        # Each index also holds the rowid (stream_offset): an equality filter comes out in stream order,
        # so "ORDER BY stream_offset LIMIT n" reads n index entries, not every match.
        "CREATE INDEX dead_letters_endpoint ON dead_letters (endpoint_id)",
        "CREATE INDEX dead_letters_tenant ON dead_letters (tenant)",
        "CREATE INDEX dead_letters_event ON dead_letters (event_id)",
        "CREATE INDEX dead_letters_dead_at ON dead_letters (dead_at_us)",
    ),
)

_COLUMNS = "stream_offset, event_id, endpoint_id, tenant, type, reason, attempts, last_status, last_error, dead_at_us"
_Row = tuple[int, str | None, str | None, str | None, str | None, str, int, int | None, str, int]

#: The longest error text an analysis compares (a prefix: errors differ in their details).
ANALYSIS_ERROR_CHARS = 120


@dataclass(frozen=True, slots=True)
class _Redriven:
    offsets: tuple[int, ...]


class DeadLetterIndex:
    """The dead letters not yet redriven, in the order they died: a view of the stream
    ``hookline.dead-letters`` kept in SQLite (the ingest lists and redrives from it, the monitor
    analyses it).

    A follower of the stream hands each record to :meth:`apply`, which only buffers it;
    :meth:`flush` writes the buffer and the offset reached in one transaction. Reads flush first, so
    they see every record applied, a redrive's own record included. Open with ``async with``; start
    following the stream at :attr:`next_offset`. ``path`` None keeps the view in memory (tests);
    ``identity`` names the stream, e.g. ``"<vhost>/hookline.dead-letters"``.
    """

    def __init__(self, path: str | Path | None = None, *, identity: str = DEAD_LETTER_STREAM) -> None:
        self._store = ViewStore(path, schema=SCHEMA, identity=identity)
        # Applied, in stream order, but not yet written: rows to insert, and redrive records.
        self._changes: list[_Row | _Redriven] = []
        self._applied: Applied | None = None  # the last record applied, written or not
        # One flush at a time: a failed one puts its changes back ahead of the later ones.
        self._flushing = asyncio.Lock()

    async def __aenter__(self) -> Self:
        await self._store.open()
        self._applied = self._store.last_applied
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.flush()  # so that a restart resumes right after the last record applied
        finally:
            await self._store.close()

    @property
    def next_offset(self) -> Offset:
        """Where to start following the stream: after the last record written."""
        return self._store.next_offset

    @property
    def last_applied(self) -> Applied | None:
        """The last record written (offset, message id), to check a re-read stream against; see
        :func:`hookline.shared.broker.views.continues`."""
        return self._store.last_applied

    @property
    def pending(self) -> int:
        """Records applied and not yet written: flush when this grows large."""
        return len(self._changes)

    def apply(self, message: StreamMessage) -> None:
        """Take the next record of the stream (in stream order); buffered until :meth:`flush`."""
        headers = message.headers or {}
        offset = headers.get("x-stream-offset")
        # A record read a second time (a consumer re-attached before its acks were counted) must not
        # bring back a dead letter redriven since.
        if not isinstance(offset, int) or (self._applied is not None and offset <= self._applied[0]):
            return
        self._applied = (offset, message.message_id)
        if REDRIVEN_HEADER in headers:
            redriven = _redriven_offsets(message.body)
            if redriven is None:
                log.error("redrive_record_unreadable", offset=offset)
            else:
                self._changes.append(_Redriven(redriven))
            return
        try:
            item = read_item(
                offset, message.body, headers, message_id=message.message_id, timestamp=message.timestamp,
                routing_key=getattr(message, "routing_key", None),
            )  # fmt: skip
        except ValueError as exc:
            log.error("dead_letter_unreadable", offset=offset, error=str(exc)[:200])
            return
        self._changes.append(_row(offset, item))

    async def flush(self) -> None:
        """Write the records applied so far, and the offset reached, in one transaction."""
        async with self._flushing:
            changes, applied = self._changes, self._applied
            if applied is None or (not changes and applied == self._store.last_applied):
                return
            self._changes = []
            try:
                await self._store.write(partial(_write_changes, changes), applied=applied)
            except Exception:
                # Rolled back: written next time, still ahead of the records applied since. (When the
                # flush is cancelled instead, the write goes on without us: nothing to put back.)
                self._changes[:0] = changes
                raise

    async def reset(self, *, reason: str) -> None:
        """Forget everything (the stream was recreated): follow the stream again from ``"first"``."""
        async with self._flushing:
            self._changes = []
            self._applied = None
            await self._store.reset(reason=reason)

    async def select(
        self,
        *,
        endpoint_id: str | None = None,
        tenant: str | None = None,
        reason: DeadLetterReason | None = None,
        event_id: str | None = None,
        ids: Collection[str] | None = None,
        after: str | None = None,
        limit: int | None = None,
    ) -> list[DeadLetterItem]:
        """The dead letters matching every filter given, in stream order; ``after`` (a dead letter's
        id) starts past it, for paging. Ids that are not dead-letter ids match nothing."""
        clauses, parameters = _filters(
            endpoint_id=endpoint_id, tenant=tenant, reason=reason, event_id=event_id
        )
        if ids is not None:
            wanted = sorted({offset for offset in map(offset_of, ids) if offset is not None})
            # One parameter however many ids (a redrive may name 10,000).
            clauses.append("stream_offset IN (SELECT value FROM json_each(?))")
            parameters.append(orjson.dumps(wanted).decode())
        after_offset = offset_of(after) if after is not None else None
        if after_offset is not None:
            clauses.append("stream_offset > ?")
            parameters.append(after_offset)
        query = f"SELECT {_COLUMNS} FROM dead_letters{_where(clauses)} ORDER BY stream_offset"  # noqa: S608
        if limit is not None:
            query += " LIMIT ?"
            parameters.append(limit)
        await self.flush()
        rows: list[_Row] = await self._store.read(lambda db: db.execute(query, parameters).fetchall())
        return [_item(row) for row in rows]

    async def count(self, *, tenant: str | None = None) -> int:
        """How many dead letters are waiting (for one tenant, or all)."""
        clauses, parameters = _filters(tenant=tenant)
        query = f"SELECT count(*) FROM dead_letters{_where(clauses)}"  # noqa: S608
        await self.flush()
        row = await self._store.read(lambda db: db.execute(query, parameters).fetchone())
        return int(row[0])

    async def analysis(self, *, tenant: str | None = None) -> list[DeadLetterAnalysis]:
        """Per endpoint, most dead letters first: how many, the most common reason, error and status,
        the first and the last, the mean attempts. Ties go to what died first."""
        clauses, parameters = _filters(tenant=tenant)
        query = _ANALYSIS.format(where=_where(clauses))
        await self.flush()
        rows: list[tuple[Any, ...]] = await self._store.read(
            lambda db: db.execute(query, [ANALYSIS_ERROR_CHARS, *parameters]).fetchall()
        )
        return [
            DeadLetterAnalysis(
                endpoint_id=endpoint_id,
                tenant=group_tenant,
                count=n,
                most_common_reason=DeadLetterReason(reason),
                most_common_error=error,
                most_common_status=status,
                first_at=_from_us(first_us),
                last_at=_from_us(last_us),
                mean_attempts=round(total_attempts / n, 2),
            )
            for endpoint_id, group_tenant, n, reason, error, status, first_us, last_us, total_attempts in rows
        ]

    async def counts_since(self, since: datetime) -> Counter[str]:
        """Dead letters per endpoint that died at or after ``since`` (the "growing" alert)."""
        await self.flush()
        rows: list[tuple[str, int]] = await self._store.read(
            lambda db: db.execute(
                # Named: left to itself, SQLite scans the endpoint index to group without sorting,
                # every row, when the last minutes are a few rows of the dead_at index.
                "SELECT endpoint_id, count(*) FROM dead_letters INDEXED BY dead_letters_dead_at"
                " WHERE dead_at_us >= ? AND endpoint_id != '' GROUP BY endpoint_id",
                (_to_us(since),),
            ).fetchall()
        )
        return Counter(dict(rows))

    async def expire(self, before: datetime) -> int:
        """Forget the dead letters that died before ``before`` (the stream keeps them for as long as
        its retention says, the view need not); how many went."""
        await self.flush()
        deleted: int = await self._store.write(
            lambda db: db.execute("DELETE FROM dead_letters WHERE dead_at_us < ?", (_to_us(before),)).rowcount
        )
        return deleted


# Per endpoint (NULL is a group of its own, as the index grouped None): the counts in one pass, then
# the most common value of three columns, ties broken by the earliest record, as Counter.most_common
# breaks them in insertion order. The endpoint's tenant is its earliest dead letter's.
_ANALYSIS = """
WITH chosen AS (
    SELECT stream_offset, endpoint_id, reason, substr(last_error, 1, ?) AS error, last_status, attempts,
           dead_at_us
    FROM dead_letters{where}
),
endpoints AS (
    SELECT endpoint_id, count(*) AS n, min(stream_offset) AS first_offset, min(dead_at_us) AS first_us,
           max(dead_at_us) AS last_us, sum(attempts) AS total_attempts
    FROM chosen GROUP BY endpoint_id
),
reasons AS (
    SELECT endpoint_id, reason AS value,
           row_number() OVER (PARTITION BY endpoint_id ORDER BY count(*) DESC, min(stream_offset)) AS rank
    FROM chosen GROUP BY endpoint_id, reason
),
errors AS (
    SELECT endpoint_id, error AS value,
           row_number() OVER (PARTITION BY endpoint_id ORDER BY count(*) DESC, min(stream_offset)) AS rank
    FROM chosen GROUP BY endpoint_id, error
),
statuses AS (
    SELECT endpoint_id, last_status AS value,
           row_number() OVER (PARTITION BY endpoint_id ORDER BY count(*) DESC, min(stream_offset)) AS rank
    FROM chosen WHERE last_status != 0 GROUP BY endpoint_id, last_status
)
SELECT e.endpoint_id, earliest.tenant, e.n, r.value, x.value, s.value, e.first_us, e.last_us,
       e.total_attempts
FROM endpoints AS e
JOIN dead_letters AS earliest ON earliest.stream_offset = e.first_offset
JOIN reasons AS r ON r.endpoint_id IS e.endpoint_id AND r.rank = 1
JOIN errors AS x ON x.endpoint_id IS e.endpoint_id AND x.rank = 1
LEFT JOIN statuses AS s ON s.endpoint_id IS e.endpoint_id AND s.rank = 1
ORDER BY e.n DESC, e.first_offset
"""


def _filters(
    *,
    endpoint_id: str | None = None,
    tenant: str | None = None,
    reason: DeadLetterReason | None = None,
    event_id: str | None = None,
) -> tuple[list[str], list[object]]:
    """SQL conditions for the filters given; the values travel as parameters, never in the text."""
    given = {
        "endpoint_id": endpoint_id,
        "tenant": tenant,
        "reason": reason.value if reason is not None else None,
        "event_id": event_id,
    }
    chosen = {column: value for column, value in given.items() if value is not None}
    return [f"{column} = ?" for column in chosen], list(chosen.values())


def _where(clauses: list[str]) -> str:
    return f" WHERE {' AND '.join(clauses)}" if clauses else ""


def _write_changes(changes: list[_Row | _Redriven], db: sqlite3.Connection) -> None:
    # In order, by runs: a redrive record may name dead letters inserted earlier in the same batch.
    for is_redrive, run in groupby(changes, key=lambda change: isinstance(change, _Redriven)):
        if is_redrive:
            db.executemany(
                "DELETE FROM dead_letters WHERE stream_offset = ?",
                [(offset,) for change in run if isinstance(change, _Redriven) for offset in change.offsets],
            )
        else:
            db.executemany(
                f"INSERT OR REPLACE INTO dead_letters ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",  # noqa: S608
                [change for change in run if not isinstance(change, _Redriven)],
            )


def _redriven_offsets(body: bytes) -> tuple[int, ...] | None:
    """The offsets a redrive record names; None when the body is not ``{"ids": [...]}``."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    ids = data.get("ids", []) if isinstance(data, dict) else None
    if not isinstance(ids, list):
        return None
    offsets = (offset_of(dead_letter_id) for dead_letter_id in ids if isinstance(dead_letter_id, str))
    return tuple(offset for offset in offsets if offset is not None)


def _row(offset: int, item: DeadLetterItem) -> _Row:
    return (
        offset,
        item.event_id,
        item.endpoint_id,
        item.tenant,
        item.type,
        item.reason.value,
        item.attempts,
        item.last_status,
        item.last_error,
        _to_us(item.dead_at),
    )


def _item(row: _Row) -> DeadLetterItem:
    (
        offset,
        event_id,
        endpoint_id,
        tenant,
        event_type,
        reason,
        attempts,
        last_status,
        last_error,
        dead_at_us,
    ) = row
    return DeadLetterItem(
        id=item_id(offset),
        event_id=event_id,
        endpoint_id=endpoint_id,
        tenant=tenant,
        type=event_type,
        reason=DeadLetterReason(reason),
        attempts=attempts,
        last_status=last_status,
        last_error=last_error,
        dead_at=_from_us(dead_at_us),
    )


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def _to_us(moment: datetime) -> int:
    # Exact integer arithmetic (a float timestamp rounds). A naive time is UTC, as read_item takes it.
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return (aware - _EPOCH) // _MICROSECOND


def _from_us(microseconds: int) -> datetime:
    return _EPOCH + timedelta(microseconds=microseconds)
