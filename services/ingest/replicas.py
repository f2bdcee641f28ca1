"""The dispatchers this ingest hears from, and how far each has read the endpoint change log.

A dispatcher fans a lane message out to the endpoints it knows (:mod:`hookline.shared.broker.topology`), so an
endpoint created (or given new patterns) a moment ago would miss an event taken by a replica whose copy
of the change log is a few milliseconds behind. Each dispatcher says, in a heartbeat sent at once when
it applies an endpoint's record, the offset it has applied; the ingest answers a new endpoint (and binds
a pattern its lane did not have yet) only once every live dispatcher has applied its record, so that an
event published after the answer reaches it whichever replica takes the event. Live: heard from within
``LIVE_S`` and not stopping; a dispatcher that stops hearing (killed) is not waited for after that.

Fed by the delivery log, which reads every telemetry record anyway. An ingest that has just started
knows no dispatcher until their next heartbeats (within 5 s); it waits for none meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from hookline.shared.contracts.telemetry import Heartbeat

#: Heartbeats come every 5 s: a dispatcher silent for two of them is not waited for.
LIVE_S = 12.0


class Replicas:
    def __init__(self) -> None:
        self._last: dict[str, Heartbeat] = {}
        self._heard = asyncio.Event()

    def observe(self, beat: Heartbeat) -> None:
        if time.time() - beat.at_s > LIVE_S:
            return  # read while catching up: says nothing of now
        self._last[beat.dispatcher_id] = beat
        self._heard.set()

    def lagging(self, offset: int, *, now_s: float) -> list[str]:
        """Live dispatchers that have not applied the change-log record at ``offset`` yet."""
        return [
            dispatcher_id
            for dispatcher_id, beat in self._last.items()
            if now_s - beat.at_s <= LIVE_S
            and not beat.stopping
            and beat.applied_offset is not None  # a version that does not say: not waited for
            and beat.applied_offset < offset
        ]

    async def applied(self, offset: int, *, timeout_s: float) -> list[str]:
        """Wait until every live dispatcher has applied ``offset``; those still behind at the deadline."""
        deadline_s = time.monotonic() + timeout_s
        while lagging := self.lagging(offset, now_s=time.time()):
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                return lagging
            self._heard.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._heard.wait(), timeout=min(left_s, 1.0))
        return []
