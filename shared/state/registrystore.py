"""The endpoint registry on local disk: a SQLite view of the change log, so that a service keeps a
million endpoints without holding them in memory, and starts from where it was instead of reading the
whole log again.

Rows by id (with the tenant and the notifier an endpoint names, both indexed), the deleted endpoints'
last definitions, the placements, the event types, the tenants' tokens and quotas, and the offset of the
last change-log record they add up to. Everything a record changes is written in the transaction that
records its offset, so the file is always the state of the log up to that offset: a service resumes
from the next record (:mod:`~hookline.shared.state.batchedfile` batches the transactions and keeps the
checkpoints off the event loop).

Like every local file it is derived from a stream (:mod:`hookline.shared.state.statefiles`): a file found
damaged at open is set aside and rebuilt from the first record; one found damaged in use stops the
process (exit 70), whose next start rebuilds it, since the registry cannot answer without it.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog

from hookline.shared.state.batchedfile import BatchedFile

log = structlog.get_logger(__name__)

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


def _exit_damaged(path: Path | None) -> None:
    log.error("registry_store_damaged", path=str(path), exit_code=EXIT_DAMAGED, alert=True)
    os._exit(EXIT_DAMAGED)  # the next start rebuilds it from the change log


class EndpointTable:
    """The rows of endpoints, and of those deleted, by id."""

    def __init__(self, batch: BatchedFile) -> None:
        self._batch = batch

    def endpoint(self, endpoint_id: str) -> bytes | None:
        row = self._batch.one("SELECT body FROM endpoints WHERE id = ?", (endpoint_id,))
        return row[0] if row else None

    def of_tenant(self, tenant: str) -> list[bytes]:
        sql = "SELECT body FROM endpoints WHERE tenant = ? ORDER BY id"
        return [r[0] for r in self._batch.all(sql, (tenant,))]

    def count(self, tenant: str | None = None) -> int:
        if tenant is None:
            row = self._batch.one("SELECT count(*) FROM endpoints", ())
        else:
            row = self._batch.one("SELECT count(*) FROM endpoints WHERE tenant = ?", (tenant,))
        return int(row[0]) if row else 0

    def page(self, *, tenant: str | None, after: str | None, limit: int) -> list[bytes]:
        """Endpoints in id order after ``after``, of ``tenant`` when given."""
        where, args = ["id > ?"], [after or ""]
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        sql = f"SELECT body FROM endpoints WHERE {' AND '.join(where)} ORDER BY id LIMIT ?"  # noqa: S608
        return [r[0] for r in self._batch.all(sql, (*args, limit))]

    def every(self, *, unlaned_only: bool = False, batch: int = 1_000) -> Iterator[bytes]:
        """Every endpoint (or those not on a lane yet), in id order, a batch at a time."""
        after = ""
        laned = "AND laned = 0" if unlaned_only else ""
        sql = f"SELECT id, body FROM endpoints WHERE id > ? {laned} ORDER BY id LIMIT ?"  # noqa: S608
        while rows := self._batch.all(sql, (after, batch)):
            yield from (body for _, body in rows)
            after = rows[-1][0]

    def tenants(self) -> list[str]:
        return [r[0] for r in self._batch.all("SELECT DISTINCT tenant FROM endpoints ORDER BY tenant", ())]

    def named(self, notifier_id: str) -> bool:
        """Whether an endpoint names this notifier."""
        sql = "SELECT 1 FROM endpoints WHERE notifier = ? LIMIT 1"
        return self._batch.one(sql, (notifier_id,)) is not None

    def deleted(self, endpoint_id: str) -> tuple[bytes, float] | None:
        row = self._batch.one("SELECT body, at_s FROM deleted WHERE id = ?", (endpoint_id,))
        return (row[0], float(row[1])) if row else None

    def deleted_since(self, since_s: float, tenant: str | None = None) -> list[tuple[bytes, float]]:
        if tenant is None:
            rows = self._batch.all("SELECT body, at_s FROM deleted WHERE at_s >= ? ORDER BY at_s", (since_s,))
        else:
            rows = self._batch.all(
                "SELECT body, at_s FROM deleted WHERE tenant = ? AND at_s >= ? ORDER BY at_s",
                (tenant, since_s),
            )
        return [(r[0], float(r[1])) for r in rows]

    # --- writes (in the open transaction; committed with the offset) ---

    def put(self, endpoint_id: str, tenant: str, notifier: str | None, laned: bool, body: bytes) -> None:
        self._batch.write(
            "INSERT OR REPLACE INTO endpoints VALUES (?, ?, ?, ?, ?)",
            (endpoint_id, tenant, notifier, int(laned), body),
        )
        self._batch.write("DELETE FROM deleted WHERE id = ?", (endpoint_id,))

    def delete(self, endpoint_id: str, tenant: str, at_s: float, body: bytes) -> None:
        self._batch.write("DELETE FROM endpoints WHERE id = ?", (endpoint_id,))
        self._batch.write(
            "INSERT OR REPLACE INTO deleted VALUES (?, ?, ?, ?)", (endpoint_id, tenant, at_s, body)
        )


class RegistryStore:
    """The registry's rows (``path`` None: in memory, rebuilt at every start): the endpoints
    (:attr:`endpoints`), what else records keep (placements, event types, tokens, quotas) and the
    offset they add up to."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        identity: str,
        reads: str = "",
        on_damaged: Callable[[Path | None], None] = _exit_damaged,
    ) -> None:
        self.batch = BatchedFile(path, prepare=_prepare, on_damaged=on_damaged)
        self.endpoints = EndpointTable(self.batch)
        self._identity = identity
        self._reads = reads  # a fingerprint of the records this version can read
        self._opened = False

    @property
    def path(self) -> Path | None:
        return self.batch.file.path

    def open(self) -> int | None:
        """Open (a damaged file is set aside and a fresh one used); the offset of the last record the file
        holds, or None when it must be built from the first (new, or another vhost's or stream's).
        Opened already, what it holds now."""
        if not self._opened:
            self.batch.file.open()
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
        self.batch.close(opened=self._opened)
        self._opened = False

    def _reset(self) -> None:
        self.batch.run(lambda c: c.executescript(
            "DELETE FROM endpoints; DELETE FROM deleted; DELETE FROM kept; DELETE FROM state;"
        ))  # fmt: skip
        self.batch.run(lambda c: c.execute("INSERT INTO state VALUES ('identity', ?)", (self._identity,)))

    def reset(self) -> None:
        """Start over (the stream was deleted and begins again)."""
        self.batch.commit_pending()
        self._reset()

    def kept(self, kind: str) -> list[bytes]:
        return [r[0] for r in self.batch.all("SELECT body FROM kept WHERE kind = ? ORDER BY key", (kind,))]

    def state(self, key: str) -> str | None:
        row = self.batch.one("SELECT value FROM state WHERE key = ?", (key,))
        return str(row[0]) if row else None

    def keep(self, kind: str, key: str, body: bytes | None) -> None:
        if body is None:
            self.batch.write("DELETE FROM kept WHERE kind = ? AND key = ?", (kind, key))
        else:
            self.batch.write("INSERT OR REPLACE INTO kept VALUES (?, ?, ?)", (kind, key, body))

    def skipped(self) -> None:
        """A record this version cannot read was passed over: a version that reads others rebuilds."""
        self.set_state("skipped_by", self._reads)

    def set_state(self, key: str, value: str) -> None:
        self.batch.write("INSERT OR REPLACE INTO state VALUES (?, ?)", (key, value))

    def applied(self, offset: int) -> None:
        """The record at ``offset`` is applied: committed with it, soon."""
        self.batch.begin()
        self.batch.run(
            lambda c: c.execute("INSERT OR REPLACE INTO state VALUES ('offset', ?)", (str(offset),))
        )
        self.batch.record_written()

    def commit(self) -> None:
        self.batch.commit()
