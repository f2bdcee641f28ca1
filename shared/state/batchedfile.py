"""A local SQLite state file written in batched transactions: everything one record changes is written
in the transaction that records its offset, committed every ``COMMIT_RECORDS`` records or
``COMMIT_AFTER_S``; reads go through the same connection, so they see what is not committed yet. They
run on the owner's event loop; what would hold it longest does not: the copy of the write-ahead log
into the file (a checkpoint, with its two fsyncs) runs after each commit on a thread of the file's own,
through a connection of its own. Left to SQLite, the commit that passed 1,000 pages did it in place, on
the loop: beside a million endpoints, dispatchers were held 0.4-0.5 s at a time while endpoints were
registered (docs/decisions.md)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog

from hookline.shared.state.statefiles import StateFile, damaged

log = structlog.get_logger(__name__)

#: A transaction is committed after this many records, or this long after its first.
COMMIT_RECORDS = 2_000
COMMIT_AFTER_S = 0.5
#: The write-ahead log's size past which a commit checkpoints and truncates it itself (_checkpoint_soon).
WAL_LIMIT_BYTES = 64 * 1024 * 1024


def _wal_bytes(path: Path) -> int:
    try:
        return path.with_name(f"{path.name}-wal").stat().st_size
    except FileNotFoundError:
        return 0


def _checkpoint(path: Path) -> None:
    """The write-ahead log copied into the file as far as no reader needs it (PASSIVE: never waits for
    the owner's connection, which goes on writing meanwhile)."""
    try:
        connection = sqlite3.connect(path, timeout=0)
        try:
            connection.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            connection.close()
    except sqlite3.Error as exc:  # busy, or damaged: the owner's own reads and writes find out which
        log.warning("registry_checkpoint_failed", path=str(path), error=str(exc))


class BatchedFile:
    def __init__(
        self,
        path: str | Path | None,
        *,
        prepare: Callable[[sqlite3.Connection], None],
        on_damaged: Callable[[Path | None], None],
    ) -> None:
        """``path`` None: in memory. ``on_damaged``: called when a read or write finds the file damaged
        (then the error is raised)."""
        self.file: StateFile[None] = StateFile(path, prepare=prepare)
        self._on_damaged = on_damaged
        self._in_transaction = 0  # records written since the transaction began
        self._began_s = 0.0
        self._commit_timer: asyncio.TimerHandle | None = None
        self._checkpointer: ThreadPoolExecutor | None = None
        self._checkpointing: Future[None] | None = None
        self.before_commit: Callable[[], None] = lambda: None  # writes the small state of the moment

    def close(self, *, opened: bool) -> None:
        """What was not committed, committed; the checkpoint under way, if any, ended; the file closed."""
        if self._commit_timer is not None:
            self._commit_timer.cancel()
        if opened and self.file.connection.in_transaction:
            self.commit()
        if self._checkpointer is not None:
            self._checkpointer.shutdown(wait=True)
            self._checkpointer = self._checkpointing = None
        self.file.close()

    def record_written(self) -> None:
        """One more record is in the transaction: committed now if the batch is full or old enough,
        else soon."""
        self._in_transaction += 1
        if self._in_transaction >= COMMIT_RECORDS or time.monotonic() - self._began_s >= COMMIT_AFTER_S:
            self.commit()
        elif self._commit_timer is None:
            try:
                self._commit_timer = asyncio.get_running_loop().call_later(COMMIT_AFTER_S, self.commit)
            except RuntimeError:  # no event loop (a synchronous caller): at once
                self.commit()

    def commit_pending(self) -> None:
        """Commit what records are in the transaction, if any (before the file starts over)."""
        if self._in_transaction:
            self.commit()

    def commit(self) -> None:
        if self._commit_timer is not None:
            self._commit_timer.cancel()
            self._commit_timer = None
        if not self.file.connection.in_transaction:
            self._in_transaction = 0
            return
        self.before_commit()
        self.run(lambda c: c.execute("COMMIT"))
        self._in_transaction = 0
        self._checkpoint_soon()

    def _checkpoint_soon(self) -> None:
        """A checkpoint on the file's thread, unless one is under way (the next commit asks again).
        The log is only restarted from its beginning once a checkpoint has copied all of it before a
        transaction begins: a writer that never pauses (a first start reading the whole change log)
        would grow it without end (844 MiB after 50,000 endpoints in an experiment), so past
        ``WAL_LIMIT_BYTES`` it is checkpointed and truncated here, at the cost of holding the loop
        that once."""
        path = self.file.path
        if path is None:
            return
        if _wal_bytes(path) >= WAL_LIMIT_BYTES:
            if self._checkpointing is not None:
                self._checkpointing.result()  # a checkpoint on the thread ends first (never raises)
            self.run(lambda c: c.execute("PRAGMA wal_checkpoint(TRUNCATE)"))
            return
        if self._checkpointing is not None and not self._checkpointing.done():
            return
        if self._checkpointer is None:
            self._checkpointer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="registry-checkpoint")
        self._checkpointing = self._checkpointer.submit(_checkpoint, path)

    def begin(self) -> None:
        if not self.file.connection.in_transaction:
            self.run(lambda c: c.execute("BEGIN"))
            self._began_s = time.monotonic()

    def write(self, sql: str, args: tuple[Any, ...]) -> None:
        self.begin()
        self.run(lambda c: c.execute(sql, args))

    def one(self, sql: str, args: tuple[Any, ...]) -> Any:
        return self.run(lambda c: c.execute(sql, args).fetchone())

    def all(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        rows: list[Any] = self.run(lambda c: c.execute(sql, args).fetchall())
        return rows

    def run(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        try:
            return fn(self.file.connection)
        except sqlite3.DatabaseError as error:
            if not damaged(error):
                raise
            self._on_damaged(self.file.path)
            raise
