"""Waiting until this dispatcher has read the endpoint log as far as it goes now, shared between the
messages that ask at once: an event refused by the catalog's schema is checked again against the
catalog as it now is before it is dead-lettered (the type may have been registered a moment ago)."""

from __future__ import annotations

import asyncio
import time

from hookline.shared.state.registry import ChangeLog

#: The least time between two syncs' markers: the log keeps every record for ever, and a flood of events
#: refused by a schema must not grow it by hundreds a second.
CAUGHT_UP_EVERY_S = 1.0


class CaughtUp:
    def __init__(self, change_log: ChangeLog) -> None:
        self._change_log = change_log
        self._lock = asyncio.Lock()
        self._asked = self._done_to = 0
        self._at_s = -CAUGHT_UP_EVERY_S

    async def wait(self, *, timeout_s: float) -> None:
        """As :meth:`ChangeLog.sync`, shared: whoever calls while a sync is under way waits for the next
        one, which covers every caller before it began, and syncs are ``CAUGHT_UP_EVERY_S`` apart at
        least. A flood of callers (every event of a burst refused by a schema) writes a marker a second
        between them, not one each."""
        self._asked += 1
        asked = self._asked
        async with self._lock:
            if self._done_to >= asked:
                return  # a sync begun after this call has finished meanwhile
            await asyncio.sleep(self._at_s + CAUGHT_UP_EVERY_S - time.monotonic())
            covering = self._asked
            await self._change_log.sync(timeout_s=timeout_s)
            self._at_s = time.monotonic()
            self._done_to = covering
