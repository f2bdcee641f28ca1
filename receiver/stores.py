"""Stores of the webhook ids a receiver has handled, so that a retried, resent or replayed delivery runs
its handler once.

The lifecycle is claim, then complete or release:

- ``claim(webhook_id)`` takes the id for a short lease (``lease_s``) unless it is handled already (DONE)
  or another request holds a live lease on it (BUSY): of concurrent duplicates, one handles, the others
  are told to come back later.
- ``complete(claim)`` after the handler succeeded: the id is DONE for ``ttl_s``.
- ``release(claim)`` after the handler failed: the id is free again, so hookline's retry is handled.

A lease that runs out (the process died while handling) frees the id too. ``ttl_s`` must outlast
hookline's retries (3 days by default) and any resend an operator may do; 7 days covers the event log.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import os
import secrets
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeGuard, cast

DEFAULT_TTL_S = 7 * 24 * 3600
DEFAULT_LEASE_S = 60.0
DEFAULT_MAX_ENTRIES = 100_000

Clock = Callable[[], float]


class Status(enum.Enum):
    CLAIMED = "claimed"  # this caller handles the id now
    DONE = "done"  # handled before, within ttl_s
    BUSY = "busy"  # another caller holds a live lease on it


@dataclass(frozen=True, slots=True)
class Claim:
    webhook_id: str
    status: Status
    # Set when CLAIMED: release() frees only the caller's own lease, never a later claimer's.
    token: str = ""


class SeenStore(Protocol):
    def claim(self, webhook_id: str) -> Claim: ...

    def complete(self, claim: Claim) -> None: ...

    def release(self, claim: Claim) -> None: ...


class AsyncSeenStore(Protocol):
    async def claim(self, webhook_id: str) -> Claim: ...

    async def complete(self, claim: Claim) -> None: ...

    async def release(self, claim: Claim) -> None: ...


def new_token() -> str:
    return secrets.token_hex(16)


def is_async(store: SeenStore | AsyncSeenStore) -> TypeGuard[AsyncSeenStore]:
    return inspect.iscoroutinefunction(store.claim)


class ThreadedStore:
    """An AsyncSeenStore over a SeenStore: each call runs in a worker thread, so that a file or network
    store never blocks the event loop."""

    def __init__(self, store: SeenStore) -> None:
        self.store = store

    async def claim(self, webhook_id: str) -> Claim:
        return await asyncio.to_thread(self.store.claim, webhook_id)

    async def complete(self, claim: Claim) -> None:
        await asyncio.to_thread(self.store.complete, claim)

    async def release(self, claim: Claim) -> None:
        await asyncio.to_thread(self.store.release, claim)


def as_async(store: SeenStore | AsyncSeenStore) -> AsyncSeenStore:
    if is_async(store):
        return store
    return ThreadedStore(cast(SeenStore, store))  # TypeGuard does not narrow the other branch


@dataclass(slots=True)
class _Entry:
    done: bool
    token: str
    expires_at_s: float


class MemoryStore:
    """In this process only, bounded: past ``max_entries`` the least recently seen ids are forgotten (a
    duplicate of one of those would run again). Thread-safe. For one process, or tests."""

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        lease_s: float = DEFAULT_LEASE_S,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        clock: Clock = time.monotonic,
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.ttl_s = ttl_s
        self.lease_s = lease_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def claim(self, webhook_id: str) -> Claim:
        now_s = self._clock()
        with self._lock:
            entry = self._entries.get(webhook_id)
            if entry is not None and entry.expires_at_s > now_s:
                self._entries.move_to_end(webhook_id)
                return Claim(webhook_id, Status.DONE if entry.done else Status.BUSY)
            token = new_token()
            self._put(webhook_id, _Entry(done=False, token=token, expires_at_s=now_s + self.lease_s))
            return Claim(webhook_id, Status.CLAIMED, token)

    def complete(self, claim: Claim) -> None:
        # Unconditional: the handler succeeded, whoever holds the lease now.
        expires_at_s = self._clock() + self.ttl_s
        with self._lock:
            self._put(claim.webhook_id, _Entry(done=True, token=claim.token, expires_at_s=expires_at_s))

    def release(self, claim: Claim) -> None:
        with self._lock:
            entry = self._entries.get(claim.webhook_id)
            if entry is not None and not entry.done and entry.token == claim.token:
                del self._entries[claim.webhook_id]

    def _put(self, webhook_id: str, entry: _Entry) -> None:
        self._entries[webhook_id] = entry
        self._entries.move_to_end(webhook_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class SQLiteStore:
    """In a SQLite file: survives restarts, and is shared by the processes (workers) of one machine.
    Thread-safe; a claim is one IMMEDIATE transaction, so concurrent claimers in any process serialise.
    Expired rows are purged every ``purge_every`` claims."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        ttl_s: float = DEFAULT_TTL_S,
        lease_s: float = DEFAULT_LEASE_S,
        purge_every: int = 1000,
        clock: Clock = time.time,  # wall time: the file outlives the process, and other processes share it
        busy_timeout_s: float = 30.0,
    ) -> None:
        self.ttl_s = ttl_s
        self.lease_s = lease_s
        self.purge_every = purge_every
        self._clock = clock
        self._lock = threading.Lock()
        self._claims = 0
        self._db = sqlite3.connect(
            path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS hookline_seen ("
                " webhook_id TEXT PRIMARY KEY, done INTEGER NOT NULL, token TEXT NOT NULL,"
                " expires_at_s REAL NOT NULL)"
            )
            self._db.execute(
                "CREATE INDEX IF NOT EXISTS hookline_seen_expiry ON hookline_seen (expires_at_s)"
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> SQLiteStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def claim(self, webhook_id: str) -> Claim:
        now_s = self._clock()
        with self._lock:
            self._claims += 1
            if self._claims % self.purge_every == 0:
                self._db.execute("DELETE FROM hookline_seen WHERE expires_at_s <= ?", (now_s,))
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute(
                    "SELECT done FROM hookline_seen WHERE webhook_id = ? AND expires_at_s > ?",
                    (webhook_id, now_s),
                ).fetchone()
                if row is not None:
                    claim = Claim(webhook_id, Status.DONE if row[0] else Status.BUSY)
                else:
                    claim = Claim(webhook_id, Status.CLAIMED, new_token())
                    self._db.execute(
                        "INSERT OR REPLACE INTO hookline_seen VALUES (?, 0, ?, ?)",
                        (webhook_id, claim.token, now_s + self.lease_s),
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return claim

    def complete(self, claim: Claim) -> None:
        expires_at_s = self._clock() + self.ttl_s
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO hookline_seen VALUES (?, 1, ?, ?)",
                (claim.webhook_id, claim.token, expires_at_s),
            )

    def release(self, claim: Claim) -> None:
        with self._lock:
            self._db.execute(
                "DELETE FROM hookline_seen WHERE webhook_id = ? AND done = 0 AND token = ?",
                (claim.webhook_id, claim.token),
            )

    def purge(self) -> int:
        """Delete expired rows now; how many."""
        with self._lock:
            return self._db.execute(
                "DELETE FROM hookline_seen WHERE expires_at_s <= ?", (self._clock(),)
            ).rowcount

    def __len__(self) -> int:
        """Ids held, expired or not (until purged)."""
        with self._lock:
            count: int = self._db.execute("SELECT count(*) FROM hookline_seen").fetchone()[0]
            return count
