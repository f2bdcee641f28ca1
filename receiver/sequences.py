"""The newest ``sequence`` applied per subject, so that a receiver can ignore an event older than the
state it holds (an event retried after a later one of its subject was delivered, a replay).

hookline numbers the events of a subject when the upstream asks (the outbox's counter) and sends the
number in the signed body (and as ``webhook-sequence``). The number is read from the verified body,
never from the unsigned header. Check before applying, record once applied::

    if sequences.stale(delivery):
        return                      # an older state than the one applied: nothing to do
    apply(delivery.json())
    sequences.applied(delivery)

A gap (5 applied, 7 arrives) is not stale: events of types an endpoint does not subscribe to are numbered
too. In a SQLite file it survives restarts and is shared by the processes of one machine; ``":memory:"``
keeps it in this process.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading

from hookline.receiver.verify import Delivery


class Sequences:
    def __init__(self, path: str | os.PathLike[str] = ":memory:", *, busy_timeout_s: float = 30.0) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        with self._lock:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS hookline_sequences ("
                " tenant TEXT NOT NULL, subject TEXT NOT NULL, sequence INTEGER NOT NULL,"
                " PRIMARY KEY (tenant, subject))"
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Sequences:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def stale(self, delivery: Delivery) -> bool:
        """True when an event of the subject with this sequence or a later one was applied already."""
        place = _place(delivery)
        if place is None:
            return False
        tenant, subject, sequence = place
        with self._lock:
            row = self._db.execute(
                "SELECT sequence FROM hookline_sequences WHERE tenant = ? AND subject = ?", (tenant, subject)
            ).fetchone()
        return row is not None and sequence <= row[0]

    def applied(self, delivery: Delivery) -> None:
        """The event's change is made: later arrivals of older sequences are stale (never moves back)."""
        place = _place(delivery)
        if place is None:
            return
        with self._lock:
            self._db.execute(
                "INSERT INTO hookline_sequences (tenant, subject, sequence) VALUES (?, ?, ?) "
                "ON CONFLICT (tenant, subject) DO UPDATE SET sequence = excluded.sequence "
                "WHERE excluded.sequence > hookline_sequences.sequence",
                place,
            )


def _place(delivery: Delivery) -> tuple[str, str, int] | None:
    """(tenant, subject, sequence) from the verified body; None for an event without a sequence."""
    try:
        event = delivery.json()
    except json.JSONDecodeError:
        return None
    if not isinstance(event, dict):
        return None
    sequence, subject = event.get("sequence"), event.get("subject")
    if isinstance(sequence, bool) or not isinstance(sequence, int) or not isinstance(subject, str):
        return None
    return str(event.get("tenant", "")), subject, sequence
