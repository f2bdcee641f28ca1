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
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

#: A redelivery follows its connection's loss by seconds: settlements older than this are forgotten.
KEEP_S = 600.0
MAX_ENTRIES = 100_000

Key = tuple[str, str, int]  # endpoint id, event id, attempt


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

    def outcome(self, key: Key, *, now_s: float) -> str | None:
        """How this replica settled that message, if it did within ``keep_s``."""
        found = self._at.get(key)
        return found[1] if found is not None and found[0] >= now_s - self.keep_s else None

    def __len__(self) -> int:
        return len(self._at)
