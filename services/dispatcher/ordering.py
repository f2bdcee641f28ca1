"""Per-subject order for ``ordered`` endpoints: a failing event holds back the later events of its
subject, and only those.

The endpoint's queue has a single active consumer, so one dispatcher sees all of its messages. Each
event gets a sequence number when first seen (``x-hookline-seq``, nanoseconds). An event is attempted
only when no earlier event of the same subject is outstanding (being attempted, or waiting for a
retry); otherwise it is deferred through the delay queues, without an attempt, until the earlier one
is due. The cost: a blocked subject's later events cycle through the delay queues, and the endpoint is
served by one dispatcher. The state lives in that dispatcher: if it fails over, events already
deferred may go out once in the order they come back.

An earlier event is waited for only until a while after it was due (``STALE_S``): if it has not come
back by then, another replica has settled it (the half-open probe, a failover and back) or it is gone,
and waiting longer would block its subject for ever. Order then yields to progress.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: How long after it was due an earlier event still holds its subject back (by default).
STALE_S = 60.0


@dataclass
class _Outstanding:
    sequence: int
    due_s: float  # when it will be attempted (now, if it is being attempted)


@dataclass
class SubjectOrder:
    stale_s: float = STALE_S
    _subjects: dict[tuple[str, str], dict[str, _Outstanding]] = field(default_factory=dict)

    def admit(
        self, endpoint_id: str, subject: str, event_id: str, sequence: int, *, now_s: float
    ) -> int | None:
        """Record the event as outstanding; None if it may be attempted now, else the seconds to defer."""
        outstanding = self._subjects.setdefault((endpoint_id, subject), {})
        for stale in [other for other, o in outstanding.items() if o.due_s < now_s - self.stale_s]:
            del outstanding[stale]  # settled elsewhere, or lost: it no longer holds the subject
        earlier = [o for other, o in outstanding.items() if other != event_id and o.sequence < sequence]
        if not earlier:
            outstanding[event_id] = _Outstanding(sequence, now_s)
            return None
        delay_s = max(1, math.ceil(min(o.due_s for o in earlier) - now_s))
        outstanding[event_id] = _Outstanding(sequence, now_s + delay_s)
        return delay_s

    def holding(self, endpoint_id: str, subject: str, event_id: str) -> str | None:
        """The earliest other event of the subject still outstanding before ``event_id`` (the one it
        waits for), if any."""
        outstanding = self._subjects.get((endpoint_id, subject), {})
        mine = outstanding.get(event_id)
        earlier = [
            (o.sequence, other)
            for other, o in outstanding.items()
            if other != event_id and (mine is None or o.sequence < mine.sequence)
        ]
        return min(earlier)[1] if earlier else None

    def retrying(self, endpoint_id: str, subject: str, event_id: str, *, due_s: float) -> None:
        outstanding = self._subjects.get((endpoint_id, subject), {})
        if event_id in outstanding:
            outstanding[event_id].due_s = due_s

    def done(self, endpoint_id: str, subject: str, event_id: str) -> None:
        """Delivered or dead: the next event of the subject may go."""
        outstanding = self._subjects.get((endpoint_id, subject))
        if outstanding is not None:
            outstanding.pop(event_id, None)
            if not outstanding:
                del self._subjects[(endpoint_id, subject)]
