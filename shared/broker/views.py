"""Durable local views of a stream: rows a service derives from a stream, kept in one SQLite file
together with the offset they were derived up to.

Memory is then bounded by the queries rather than by the stream's history, and a restart resumes from
the offset after the last one applied instead of replaying the stream. The rows and the offset are
written in one transaction, so after a crash the view is never ahead of, nor behind, its offset.

Every SQLite call runs on one worker thread per store: writes stay in the order they were asked for,
and the event loop never waits on the disk. The file belongs to its view: when it holds another view
(another identity or schema version), every table in it is dropped and the view is rebuilt from the
stream. A file found damaged is set aside and replaced by :mod:`hookline.shared.state.statefiles`: at open
the view then starts empty; while in use the store refuses writes until its view has been reset, and
:func:`follow_view` reads the stream again from its first record.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, Self, TypeVar

import structlog

from hookline.shared.broker.streams import StreamFollower
from hookline.shared.runtime.supervision import Loop
from hookline.shared.state.statefiles import StateFile, StateFileReplacedError

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: Where a stream is read from: an offset, or "first" when nothing was applied yet.
Offset = int | Literal["first"]

#: The offset last applied and the message id seen at that offset.
Applied = tuple[int, str | None]

# The store's own table, one row: which view the file holds and how far it got. The view's tables
# come from its ViewSchema.
_META_DDL = """
CREATE TABLE meta (
    singleton INTEGER PRIMARY KEY CHECK (singleton = 1),
    identity TEXT NOT NULL,
    schema_version INTEGER NOT NULL,
    applied_offset INTEGER,
    applied_message_id TEXT
)
"""


class StreamMessage(Protocol):
    """What a view reads of a stream's message (an aio-pika incoming message is one); the offset is in
    the header ``x-stream-offset``."""

    @property
    def body(self) -> bytes: ...
    @property
    def headers(self) -> Mapping[str, Any]: ...
    @property
    def message_id(self) -> str | None: ...
    @property
    def timestamp(self) -> datetime | None: ...
    @property
    def routing_key(self) -> str | None: ...
    @property
    def user_id(self) -> str | None: ...


@dataclass(frozen=True)
class ViewSchema:
    """The view's tables and indexes. Raise ``version`` whenever the statements change, or the way rows
    are derived from records does: a file with another version is rebuilt from the stream."""

    version: int
    statements: Sequence[str]


def rebuild_reason(
    stored: tuple[str, int] | None, *, identity: str, schema_version: int, has_tables: bool
) -> str | None:
    """Why a file's content cannot be kept (None: it can). ``stored`` is its (identity, schema version)."""
    if stored is None:
        return "unreadable view metadata" if has_tables else "new file"
    stored_identity, stored_version = stored
    if stored_identity != identity:
        return f"identity {stored_identity!r} != {identity!r}"
    if stored_version != schema_version:
        return f"schema version {stored_version} != {schema_version}"
    return None


def continues(last_applied: Applied | None, offset: int, message_id: str | None) -> bool:
    """Whether the first record read when re-attaching at ``last_applied``'s offset proves that the
    stream is the one the view was built from. A recreated stream numbers its offsets from 0 again, so
    the offset alone would not tell; retention may also have removed the record the view stopped at."""
    return last_applied is None or (offset, message_id) == last_applied


class ViewStore:
    """One SQLite file (an in-memory database when ``path`` is None) holding a view and its offset.

    ``identity`` names the stream the view is built from, e.g. ``"<vhost>/<stream>"``: a file built
    from another stream is rebuilt, never mixed. Use as ``async with ViewStore(...) as store``.
    """

    def __init__(self, path: str | Path | None, *, schema: ViewSchema, identity: str) -> None:
        self._file = StateFile(path, prepare=self._prepare)
        self._path = str(path) if path is not None else ":memory:"
        self._schema = schema
        self._identity = identity
        self._executor: ThreadPoolExecutor | None = None
        # Set by the worker thread after each commit; a reference assignment, so readers on the event
        # loop see either the old or the new value.
        self._last_applied: Applied | None = None
        # Set when the file was found damaged in use and replaced: writes that record an offset are
        # refused until reset(), so that no offset is recorded in a file that lacks the rows before it.
        self.replaced = False

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def open(self) -> None:
        """Open (creating) the file; rebuild the view's tables if the file holds another view (or was
        damaged, and set aside)."""
        assert self._executor is None, "already open"
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="view")
        try:
            reason = await self._run(self._file.open)
        except BaseException:
            await self.close()
            raise
        # An in-memory view is new every time: not worth a line.
        if reason is not None and self._path != ":memory:":
            log.info("view_rebuilt", path=self._path, identity=self._identity, reason=reason)

    async def close(self) -> None:
        """Close the file, after every write asked for so far (the worker runs them in order)."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(executor, self._file.close)
        finally:
            # The worker has nothing left to run: joining it is immediate.
            executor.shutdown(wait=True)

    @property
    def last_applied(self) -> Applied | None:
        """The offset of the last record applied and its message id; None when nothing was."""
        return self._last_applied

    @property
    def next_offset(self) -> Offset:
        """Where to resume reading the stream."""
        return "first" if self._last_applied is None else self._last_applied[0] + 1

    async def write(self, fn: Callable[[sqlite3.Connection], T], *, applied: Applied | None = None) -> T:
        """Run ``fn`` in a transaction, recording ``applied`` as the last record applied in the same
        transaction; roll back if ``fn`` raises. Offsets only move forward. Raises
        :class:`~hookline.shared.state.statefiles.StateFileReplacedError` once the file was found damaged, until
        :meth:`reset`."""
        if applied is not None and self._last_applied is not None and applied[0] < self._last_applied[0]:
            raise ValueError(f"offset {applied[0]} is before the applied offset {self._last_applied[0]}")
        return await self._run(partial(self._guarded, partial(self._write, fn, applied)))

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` on the worker thread; it sees every write asked for before it."""
        return await self._run(partial(self._guarded, fn))

    async def reset(self, *, reason: str) -> None:
        """Empty the view (e.g. its stream was recreated): it is then rebuilt from the first offset."""
        # Damaged: the fresh file that replaced it is as empty as a rebuild makes it.
        with contextlib.suppress(StateFileReplacedError):
            await self._run(partial(self._file.run, self._rebuild))
        self.replaced = False
        log.info("view_rebuilt", path=self._path, identity=self._identity, reason=reason)

    async def _run(self, job: Callable[[], T]) -> T:
        if self._executor is None:
            raise RuntimeError("the view store is not open")
        future = asyncio.get_running_loop().run_in_executor(self._executor, job)
        # Shielded: a caller cancelled while waiting must not take a queued write out of the order,
        # nor leave the connection half closed; the job still runs.
        return await asyncio.shield(future)

    # --- on the worker thread ------------------------------------------------------------------------

    def _guarded(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        try:
            return self._file.run(fn)
        except StateFileReplacedError:
            self.replaced, self._last_applied = True, None
            raise

    def _prepare(self, connection: sqlite3.Connection) -> str | None:
        has_tables = bool(_table_names(connection))
        reason = rebuild_reason(
            _stored_meta(connection),
            identity=self._identity,
            schema_version=self._schema.version,
            has_tables=has_tables,
        )
        if reason is not None:
            self._rebuild(connection)
        row = connection.execute("SELECT applied_offset, applied_message_id FROM meta").fetchone()
        self._last_applied = (row[0], row[1]) if row[0] is not None else None
        return reason

    def _rebuild(self, connection: sqlite3.Connection) -> None:
        connection.execute("BEGIN IMMEDIATE")
        try:
            for kind, name in _table_names(connection):
                connection.execute(f'DROP {kind} IF EXISTS "{name.replace(chr(34), chr(34) * 2)}"')
            connection.execute(_META_DDL)
            connection.execute(
                "INSERT INTO meta (singleton, identity, schema_version) VALUES (1, ?, ?)",
                (self._identity, self._schema.version),
            )
            for statement in self._schema.statements:
                connection.execute(statement)
            connection.execute("COMMIT")
        except BaseException:
            _rollback(connection)
            raise
        self._last_applied = None

    def _write(
        self, fn: Callable[[sqlite3.Connection], T], applied: Applied | None, connection: sqlite3.Connection
    ) -> T:
        if self.replaced and applied is not None:
            raise StateFileReplacedError(f"{self._path} was replaced: reset the view before applying to it")
        connection.execute("BEGIN IMMEDIATE")
        try:
            result = fn(connection)
            if applied is not None:
                connection.execute(
                    "UPDATE meta SET applied_offset = ?, applied_message_id = ? WHERE singleton = 1", applied
                )
            connection.execute("COMMIT")
        except BaseException:
            _rollback(connection)
            raise
        if applied is not None:
            self._last_applied = applied
        return result


def _table_names(connection: sqlite3.Connection) -> list[tuple[str, str]]:
    """Every table and view in the file, the store's own meta included (SQLite's own excluded)."""
    rows = connection.execute(
        "SELECT upper(type), name FROM sqlite_master"
        " WHERE type IN ('table', 'view') AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'"
    ).fetchall()
    return [(str(kind), str(name)) for kind, name in rows]


def _stored_meta(connection: sqlite3.Connection) -> tuple[str, int] | None:
    try:
        row = connection.execute("SELECT identity, schema_version FROM meta WHERE singleton = 1").fetchone()
    except sqlite3.OperationalError:  # no meta table, or one of another layout
        return None
    return (str(row[0]), int(row[1])) if row is not None else None


def _rollback(connection: sqlite3.Connection) -> None:
    # Some errors (a full disk, for one) have already rolled the transaction back.
    if connection.in_transaction:
        connection.execute("ROLLBACK")


class View(Protocol):
    """A durable view a stream follower feeds: records applied in order, written by :meth:`flush`."""

    @property
    def last_applied(self) -> Applied | None: ...
    @property
    def pending(self) -> int: ...
    async def flush(self) -> None: ...
    async def reset(self, *, reason: str) -> None: ...


#: How often a followed view writes what it applied: what a crash can make it read again.
FLUSH_INTERVAL_S = 0.5


async def follow_view(follower: StreamFollower, view: View, loop: Loop) -> None:
    """A supervised loop body: ``follower`` (whose handler applies to ``view``) consumes the stream, and
    the view is flushed every half second, so a restart resumes after the last offset written.

    When the view's file is found damaged in use (and replaced by an empty one), the view is reset and
    the loop fails: the supervisor runs it again, from the stream's first record."""
    if follower.next_offset == "first" and view.last_applied is not None:
        # The follower saw its stream deleted (offsets start over when it is declared again).
        await view.reset(reason="the stream was deleted and declared again")
    try:
        await _consume(follower, view, loop)
    except StateFileReplacedError:
        # After the consumer has stopped, so that no record read before is applied after the reset.
        await view.reset(reason="its file was damaged and set aside")
        follower.next_offset = "first"
        raise


async def _consume(follower: StreamFollower, view: View, loop: Loop) -> None:
    consuming = asyncio.create_task(follower.run(loop), name=f"follow:{follower.stream}")
    try:
        while not consuming.done():
            await asyncio.wait({consuming}, timeout=FLUSH_INTERVAL_S)
            await view.flush()
        consuming.result()
    finally:
        consuming.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await consuming
        await view.flush()


class RowView:
    """A view whose rows are derived from each record alone (an insert log): :meth:`apply` derives and
    buffers them, :meth:`flush` writes them with the offset reached, in one transaction. Open with
    ``async with``; follow the stream from :attr:`next_offset` (see :func:`follow_view`).

    ``derive(offset, message)`` gives the rows of one record (none for a record it skips) for
    ``insert``, an ``INSERT`` statement with one placeholder per column.
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        schema: ViewSchema,
        identity: str,
        insert: str,
        derive: Callable[[int, StreamMessage], Sequence[Sequence[Any]]],
    ) -> None:
        self.store = ViewStore(path, schema=schema, identity=identity)
        self._insert = insert
        self._derive = derive
        self._rows: list[Sequence[Any]] = []
        self._applied: Applied | None = None
        self._flushing = asyncio.Lock()

    async def __aenter__(self) -> Self:
        await self.store.open()
        self._applied = self.store.last_applied
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.flush()
        finally:
            await self.store.close()

    @property
    def next_offset(self) -> Offset:
        return self.store.next_offset

    @property
    def last_applied(self) -> Applied | None:
        return self.store.last_applied

    @property
    def pending(self) -> int:
        return len(self._rows)

    def apply(self, message: StreamMessage) -> None:
        offset = (message.headers or {}).get("x-stream-offset")
        # A record read a second time (a consumer re-attached before its acks were counted) is skipped.
        if not isinstance(offset, int) or (self._applied is not None and offset <= self._applied[0]):
            return
        self._applied = (offset, message.message_id)
        self._rows.extend(self._derive(offset, message))

    async def flush(self) -> None:
        async with self._flushing:
            rows, applied = self._rows, self._applied
            if applied is None or (not rows and applied == self.store.last_applied):
                return
            self._rows = []
            try:
                await self.store.write(lambda db: db.executemany(self._insert, rows), applied=applied)
            except BaseException:
                self._rows = rows + self._rows  # written next time, ahead of what came since
                raise

    async def reset(self, *, reason: str) -> None:
        async with self._flushing:
            self._rows, self._applied = [], None
            await self.store.reset(reason=reason)

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run a query on the view, after writing every record applied so far."""
        await self.flush()
        return await self.store.read(fn)
