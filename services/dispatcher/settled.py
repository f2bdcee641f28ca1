"""The messages this replica settled lately, so that the broker's redelivery of one whose ack it never
got is acked instead of attempted again.

A message is acked only after its outcome is recorded (a 2xx, a confirmed retry copy, a confirmed dead
letter), so when the connection or the broker goes between the two, the broker hands the message out
again, marked ``redelivered``: attempted again, it would reach the endpoint twice (or leave two retry
copies, each delivered later). When that redelivery comes back to this replica, the outcome it recorded
is looked up here by (endpoint, event, attempt) and the message only acked. A redelivery that goes to
another replica, or comes after this one restarted, is attempted again: at-least-once allows it, and
the fault suite counts it.

Only a message marked ``redelivered`` is looked up, and only deliveries and their retries are kept
(what a message with the same endpoint, event and attempt can only be a copy of): a deferral's copy
keeps its attempt number (it is a new message of the same attempt), and a replay, redrive or resend
(marked with its origin) is an operator's request to send the event again, so neither is kept or
skipped. Bounded: the newest ``MAX_ENTRIES`` settlements of the last ``KEEP_S``.

It also remembers the events that came straight from ``events`` to an endpoint leaving its lane (or that
left it lately): a lane hands its copy of such an event on as a *second copy*, which reaches the
endpoint's queue behind the straight one (one active consumer takes them in order), so a second copy
whose event was taken straight here is acked unsent, whether the straight copy is delivered, waiting
for its retry or its turn, or still being attempted (its own outcome is made durable as any other's).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

#: A redelivery follows its connection's loss by seconds: settlements older than this are forgotten.
KEEP_S = 600.0
MAX_ENTRIES = 100_000

Key = tuple[str, str, int]  # endpoint id, event id, attempt

#: The attempt number of a copy taken straight from ``events`` (attempts start at 1).
_STRAIGHT = 0


@dataclass
class Settled:
    keep_s: float = KEEP_S
    max_entries: int = MAX_ENTRIES
    _at: OrderedDict[Key, tuple[float, str]] = field(default_factory=OrderedDict)  # oldest first

    def add(self, key: Key, outcome: str, *, now_s: float) -> None:
        self._at[key] = (now_s, outcome)
        self._at.move_to_end(key)
        while self._at and (
            len(self._at) > self.max_entries or next(iter(self._at.values()))[0] < now_s - self.keep_s
        ):
            self._at.popitem(last=False)

    def took_straight(self, endpoint_id: str, event_id: str, *, now_s: float) -> None:
        """An event came to this endpoint straight from ``events`` (its second copy may follow)."""
        self.add((endpoint_id, event_id, _STRAIGHT), "taken_straight", now_s=now_s)

    def outcome(self, key: Key, *, now_s: float) -> str | None:
        """How this replica settled that message, if it did within ``keep_s``."""
        found = self._at.get(key)
        return found[1] if found is not None and found[0] >= now_s - self.keep_s else None

    def second_copy(self, key: Key, *, now_s: float) -> str | None:
        """Why a second copy of that message is not sent: its event was taken straight here, or the
        message it copies was settled here."""
        endpoint_id, event_id, _ = key
        return self.outcome((endpoint_id, event_id, _STRAIGHT), now_s=now_s) or self.outcome(key, now_s=now_s)

    def __len__(self) -> int:
        return len(self._at)
