"""The endpoint registry on local disk: a SQLite view of the change log, so that a service keeps a
million endpoints without holding them in memory, and starts from where it was instead of reading the
whole log again.

Rows by id (with the tenant and the notifier an endpoint names, both indexed), the deleted endpoints'
last definitions, the placements, the event types, the tenants' tokens and quotas, and the offset of the
last change-log record they add up to. Everything a record changes is written in the transaction that
records its offset, so the file is always the state of the log up to that offset: a service resumes
from the next record. Writes are batched (one transaction per ``COMMIT_RECORDS`` records or
``COMMIT_AFTER_S``), and reads go through the same connection, so they see what is not committed yet.
They run on the owner's event loop; what would hold it longest does not: the copy of the write-ahead
log into the file (a checkpoint, with its two fsyncs) runs after each commit on a thread of the store's
own, through a connection of its own. Left to SQLite, the commit that passed 1,000 pages did it in
place, on the loop: beside a million endpoints, dispatchers were held 0.4-0.5 s at a time while
endpoints were registered (docs/decisions.md).

Like every local file it is derived from a stream (:mod:`hookline.shared.state.statefiles`): a file found
damaged at open is set aside and rebuilt from the first record; one found damaged in use stops the
process (exit 70), whose next start rebuilds it, since the registry cannot answer without it.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
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
#: What a process does when its file is damaged in use (a test replaces it).
EXIT_DAMAGED = 70

_SCHEMA = """
CREATE TABLE IF NOT EXISTS endpoints (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, notifier TEXT, laned INTEGER NOT NULL, body BLOB NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS endpoints_by_tenant ON endpoints (tenant, id);
CREATE INDEX IF NOT EXISTS endpoints_by_notifier ON endpoints (notifier) WHERE notifier IS NOT NULL;
CREATE TABLE IF NOT EXISTS deleted (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, at_s REAL NOT NULL, body BLOB NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS deleted_by_tenant ON deleted (tenant, at_s);
CREATE INDEX IF NOT EXISTS deleted_by_time ON deleted (at_s);
CREATE TABLE IF NOT EXISTS kept (kind TEXT NOT NULL, key TEXT NOT NULL, body BLOB NOT NULL, PRIMARY KEY (kind, key))
    WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
"""


def _prepare(connection: sqlite3.Connection) -> None:
    connection.executescript(_SCHEMA)
    connection.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints run on the store's thread instead


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


def _exit_damaged(path: Path | None) -> None:
    log.error("registry_store_damaged", path=str(path), exit_code=EXIT_DAMAGED, alert=True)
    os._exit(EXIT_DAMAGED)  # the next start rebuilds it from the change log


class RegistryStore:
    """The registry's rows (``path`` None: in memory, rebuilt at every start)."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        identity: str,
        reads: str = "",
        on_damaged: Callable[[Path | None], None] = _exit_damaged,
    ) -> None:
        self._file: StateFile[None] = StateFile(path, prepare=_prepare)
        self._identity = identity
        self._reads = reads  # a fingerprint of the records this version can read
        self._on_damaged = on_damaged
        self._opened = False
        self._in_transaction = 0  # records written since the transaction began
        self._began_s = 0.0
        self._commit_timer: asyncio.TimerHandle | None = None
        self._checkpointer: ThreadPoolExecutor | None = None
        self._checkpointing: Future[None] | None = None
        self.before_commit: Callable[[], None] = lambda: None  # writes the small state of the moment

    @property
    def path(self) -> Path | None:
        return self._file.path

    def open(self) -> int | None:
        """Open (a damaged file is set aside and a fresh one used); the offset of the last record the file
        holds, or None when it must be built from the first (new, or another vhost's or stream's).
        Opened already, what it holds now."""
        if not self._opened:
            self._file.open()
            self._opened = True
        if self.state("identity") != self._identity:
            self._reset()
            return None
        skipped_by = self.state("skipped_by")
        if skipped_by is not None and skipped_by != self._reads:
            # A version that could not read some records built these rows (a follower upgraded after
            # an ingest wrote what it did not know): this one may read them, so it reads the log again.
            log.warning("registry_rebuilt_for_skipped_records", path=str(self.path))
            self._reset()
            return None
        offset = self.state("offset")
        return int(offset) if offset is not None else None

    def close(self) -> None:
        if self._commit_timer is not None:
            self._commit_timer.cancel()
        if self._opened and self._file.connection.in_transaction:
            self.commit()
        if self._checkpointer is not None:
            self._checkpointer.shutdown(wait=True)  # the checkpoint under way, if any, ends first
            self._checkpointer = self._checkpointing = None
        self._file.close()
        self._opened = False

    def _reset(self) -> None:
        self._run(lambda c: c.executescript(
            "DELETE FROM endpoints; DELETE FROM deleted; DELETE FROM kept; DELETE FROM state;"
        ))  # fmt: skip
        self._run(lambda c: c.execute("INSERT INTO state VALUES ('identity', ?)", (self._identity,)))

    def reset(self) -> None:
        """Start over (the stream was deleted and begins again)."""
        if self._in_transaction:
            self.commit()
        self._reset()

    # --- reads ---

    def endpoint(self, endpoint_id: str) -> bytes | None:
        row = self._one("SELECT body FROM endpoints WHERE id = ?", (endpoint_id,))
        return row[0] if row else None

    def of_tenant(self, tenant: str) -> list[bytes]:
        return [r[0] for r in self._all("SELECT body FROM endpoints WHERE tenant = ? ORDER BY id", (tenant,))]

    def count(self, tenant: str | None = None) -> int:
        if tenant is None:
            row = self._one("SELECT count(*) FROM endpoints", ())
        else:
            row = self._one("SELECT count(*) FROM endpoints WHERE tenant = ?", (tenant,))
        return int(row[0]) if row else 0

    def page(self, *, tenant: str | None, after: str | None, limit: int) -> list[bytes]:
        """Endpoints in id order after ``after``, of ``tenant`` when given."""
        where, args = ["id > ?"], [after or ""]
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        sql = f"SELECT body FROM endpoints WHERE {' AND '.join(where)} ORDER BY id LIMIT ?"  # noqa: S608
        return [r[0] for r in self._all(sql, (*args, limit))]

    def every(self, *, unlaned_only: bool = False, batch: int = 1_000) -> Iterator[bytes]:
        """Every endpoint (or those not on a lane yet), in id order, a batch at a time."""
        after = ""
        laned = "AND laned = 0" if unlaned_only else ""
        sql = f"SELECT id, body FROM endpoints WHERE id > ? {laned} ORDER BY id LIMIT ?"  # noqa: S608
        while rows := self._all(sql, (after, batch)):
            yield from (body for _, body in rows)
            after = rows[-1][0]

    def tenants(self) -> list[str]:
        return [r[0] for r in self._all("SELECT DISTINCT tenant FROM endpoints ORDER BY tenant", ())]

    def named(self, notifier_id: str) -> bool:
        """Whether an endpoint names this notifier."""
        return self._one("SELECT 1 FROM endpoints WHERE notifier = ? LIMIT 1", (notifier_id,)) is not None

    def deleted(self, endpoint_id: str) -> tuple[bytes, float] | None:
        row = self._one("SELECT body, at_s FROM deleted WHERE id = ?", (endpoint_id,))
        return (row[0], float(row[1])) if row else None

    def deleted_since(self, since_s: float, tenant: str | None = None) -> list[tuple[bytes, float]]:
        if tenant is None:
            rows = self._all("SELECT body, at_s FROM deleted WHERE at_s >= ? ORDER BY at_s", (since_s,))
        else:
            rows = self._all(
                "SELECT body, at_s FROM deleted WHERE tenant = ? AND at_s >= ? ORDER BY at_s",
                (tenant, since_s),
            )
        return [(r[0], float(r[1])) for r in rows]

    def kept(self, kind: str) -> list[bytes]:
        return [r[0] for r in self._all("SELECT body FROM kept WHERE kind = ? ORDER BY key", (kind,))]

    def state(self, key: str) -> str | None:
        row = self._one("SELECT value FROM state WHERE key = ?", (key,))
        return str(row[0]) if row else None

    # --- writes (in the open transaction; committed with the offset) ---

    def put(self, endpoint_id: str, tenant: str, notifier: str | None, laned: bool, body: bytes) -> None:
        self._write(
            "INSERT OR REPLACE INTO endpoints VALUES (?, ?, ?, ?, ?)",
            (endpoint_id, tenant, notifier, int(laned), body),
        )
        self._write("DELETE FROM deleted WHERE id = ?", (endpoint_id,))

    def delete(self, endpoint_id: str, tenant: str, at_s: float, body: bytes) -> None:
        self._write("DELETE FROM endpoints WHERE id = ?", (endpoint_id,))
        self._write("INSERT OR REPLACE INTO deleted VALUES (?, ?, ?, ?)", (endpoint_id, tenant, at_s, body))

    def keep(self, kind: str, key: str, body: bytes | None) -> None:
        if body is None:
            self._write("DELETE FROM kept WHERE kind = ? AND key = ?", (kind, key))
        else:
            self._write("INSERT OR REPLACE INTO kept VALUES (?, ?, ?)", (kind, key, body))

    def skipped(self) -> None:
        """A record this version cannot read was passed over: a version that reads others rebuilds."""
        self.set_state("skipped_by", self._reads)

    def set_state(self, key: str, value: str) -> None:
        self._write("INSERT OR REPLACE INTO state VALUES (?, ?)", (key, value))

    def applied(self, offset: int) -> None:
        """The record at ``offset`` is applied: committed with it, soon."""
        self._begin()
        self._run(lambda c: c.execute("INSERT OR REPLACE INTO state VALUES ('offset', ?)", (str(offset),)))
        self._in_transaction += 1
        if self._in_transaction >= COMMIT_RECORDS or time.monotonic() - self._began_s >= COMMIT_AFTER_S:
            self.commit()
        elif self._commit_timer is None:
            try:
                self._commit_timer = asyncio.get_running_loop().call_later(COMMIT_AFTER_S, self.commit)
            except RuntimeError:  # no event loop (a synchronous caller): at once
                self.commit()

    def commit(self) -> None:
        if self._commit_timer is not None:
            self._commit_timer.cancel()
            self._commit_timer = None
        if not self._file.connection.in_transaction:
            self._in_transaction = 0
            return
        self.before_commit()
        self._run(lambda c: c.execute("COMMIT"))
        self._in_transaction = 0
        self._checkpoint_soon()

    def _checkpoint_soon(self) -> None:
        """A checkpoint on the store's thread, unless one is under way (the next commit asks again).
        The log is only restarted from its beginning once a checkpoint has copied all of it before a
        transaction begins: a writer that never pauses (a first start reading the whole change log)
        would grow it without end (844 MiB after 50,000 endpoints in an experiment), so past
        ``WAL_LIMIT_BYTES`` it is checkpointed and truncated here, at the cost of holding the loop
        that once."""
        path = self._file.path
        if path is None:
            return
        if _wal_bytes(path) >= WAL_LIMIT_BYTES:
            if self._checkpointing is not None:
                self._checkpointing.result()  # a checkpoint on the thread ends first (never raises)
            self._run(lambda c: c.execute("PRAGMA wal_checkpoint(TRUNCATE)"))
            return
        if self._checkpointing is not None and not self._checkpointing.done():
            return
        if self._checkpointer is None:
            self._checkpointer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="registry-checkpoint")
        self._checkpointing = self._checkpointer.submit(_checkpoint, path)

    def _begin(self) -> None:
        if not self._file.connection.in_transaction:
            self._run(lambda c: c.execute("BEGIN"))
            self._began_s = time.monotonic()

    def _write(self, sql: str, args: tuple[Any, ...]) -> None:
        self._begin()
        self._run(lambda c: c.execute(sql, args))

    def _one(self, sql: str, args: tuple[Any, ...]) -> Any:
        return self._run(lambda c: c.execute(sql, args).fetchone())

    def _all(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        rows: list[Any] = self._run(lambda c: c.execute(sql, args).fetchall())
        return rows

    def _run(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        try:
            return fn(self._file.connection)
        except sqlite3.DatabaseError as error:
            if not damaged(error):
                raise
            self._on_damaged(self._file.path)
            raise
