"""A service's local state files (SQLite): the one place that decides a file is damaged, sets it aside
and starts a fresh one, so that a damaged file costs a rebuild from its stream, never the service.

Every local file is derived: a view of a stream (the dead-letter index, the delivery log, the audit
trail) or the monitor's checkpoint of its statistics. Losing one loses nothing that cannot be read again,
so a file SQLite finds damaged (``SQLITE_CORRUPT``: truncated, a page overwritten; ``SQLITE_NOTADB``:
garbage over its header) is renamed beside itself as ``<file>.corrupt-<UTC time>``, kept for a
post-mortem and never deleted (its ``-wal`` and ``-shm`` too, when SQLite has left them: a fresh file
must never replay an old log).
One error line (``state_file_set_aside``, an alert) names the file and what SQLite said, and
``hookline_state_files_set_aside_total`` counts it, per file.

At open SQLite reads the header and the schema: garbage over the header and a truncated file (shorter
than the size its header records) are found there, and the file is replaced before its owner sees it.
A page damaged in the middle is found only when a query reads it: :meth:`StateFile.run` then replaces
the file at once and raises :class:`StateFileReplacedError`, and its owner rebuilds what the file held.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Generic, TypeVar

import prometheus_client
import structlog

log = structlog.get_logger(__name__)

T = TypeVar("T")
P = TypeVar("P")

SET_ASIDE = prometheus_client.Counter(
    "hookline_state_files_set_aside",
    "Local state files found damaged, set aside (renamed .corrupt-<time>) and started afresh.",
    ["file"],
)

#: The companions SQLite keeps beside a file in WAL mode; they go with it.
_COMPANIONS = ("-wal", "-shm")


def damaged(error: BaseException) -> bool:
    """Whether SQLite says the file itself is unreadable (not busy, not full, not missing)."""
    name = getattr(error, "sqlite_errorname", None)
    return (
        isinstance(error, sqlite3.DatabaseError)
        and isinstance(name, str)
        and (name == "SQLITE_NOTADB" or name.startswith("SQLITE_CORRUPT"))
    )


def aside_name(path: Path, now: datetime) -> Path:
    """Where a damaged file goes: beside itself, named for when it was found."""
    return path.with_name(f"{path.name}.corrupt-{now.astimezone(UTC):%Y%m%dT%H%M%S.%fZ}")


class StateFileReplacedError(Exception):
    """The file was found damaged while in use and replaced by an empty one: what it held is gone from
    it and must be rebuilt (a view, from the first record of its stream)."""


class StateFile(Generic[P]):
    """One SQLite connection to a local state file (``path`` None: in memory), used on one thread only,
    its owner's worker. ``prepare`` readies a connection (creates or checks the tables) and its result is
    what :meth:`open` returns; it runs again on the fresh file that replaces a damaged one."""

    def __init__(self, path: str | Path | None, *, prepare: Callable[[sqlite3.Connection], P]) -> None:
        self.path = Path(path) if path is not None else None
        self._prepare = prepare
        self._connection: sqlite3.Connection | None = None

    @property
    def connection(self) -> sqlite3.Connection:
        assert self._connection is not None, "the state file is not open"
        return self._connection

    def open(self) -> P:
        """Connect and prepare; a file found damaged is set aside and a fresh one prepared instead."""
        try:
            return self._connect()
        except sqlite3.DatabaseError as error:
            if self.path is None or not damaged(error):
                raise
            self._set_aside(error)
            return self._connect()

    def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn`` on the connection. When SQLite finds the file damaged, the file is set aside and a
        fresh one prepared, and :class:`StateFileReplacedError` is raised (from SQLite's error)."""
        try:
            return fn(self.connection)
        except sqlite3.DatabaseError as error:
            if self.path is None or not damaged(error):
                raise
            self._set_aside(error)
            self._connect()
            raise StateFileReplacedError(
                f"{self.path.name} was damaged ({error}) and has been set aside"
            ) from error

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def _connect(self) -> P:
        self._connection = connection = sqlite3.connect(
            ":memory:" if self.path is None else self.path, isolation_level=None
        )
        try:
            # Autocommit (isolation_level=None): the owner begins and commits its transactions.
            # WAL: a reader never waits for the writer. NORMAL: a power cut may lose the last commits,
            # never consistency (a view then resumes from an earlier offset and applies them again).
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            return self._prepare(connection)
        except BaseException:
            self.close()
            raise

    def _set_aside(self, error: sqlite3.DatabaseError) -> None:
        assert self.path is not None
        self.close()
        aside = aside_name(self.path, datetime.now(UTC))
        for suffix in ("", *_COMPANIONS):
            source = self.path.with_name(self.path.name + suffix)
            if source.exists():
                source.rename(aside.with_name(aside.name + suffix))
        SET_ASIDE.labels(self.path.name).inc()
        log.error(
            "state_file_set_aside",
            path=str(self.path),
            moved_to=str(aside),
            error=str(error),
            code=getattr(error, "sqlite_errorname", None),
            alert=True,
        )
