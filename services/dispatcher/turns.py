"""An endpoint's turns for deliveries from lanes: a few at once, the others waiting in order.

A lane message holds its place in the lane's window while it waits here, so a wait is bounded: a copy
that has not had its turn within its ``timeout_s`` is told so (the handler then decides whether its
endpoint is backlogged, lanes.py). In a backlog nearly every copy a replica holds waits, so the waits
share one timer per endpoint (the soonest deadline's), and a turn passes straight from the copy that
leaves it to the next in line: an ``asyncio.timeout`` and a semaphore per copy cost one dispatcher
draining a backlog about a tenth of its CPU (docs/decisions.md).

The number of turns is given at each call, not fixed: the handler allows fewer while its event loop
runs late (admission.py, ``CROWDED_IN_FLIGHT``), so that the copies it would not start anyway wait
here, in one line, rather than in a second one behind this.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter, deque


class Turns:
    """One endpoint's turns. ``users``: its deliveries here, waiting or under way; ``waiting``: those
    waiting, also summed per lane over every endpoint in ``lanes_waiting``."""

    __slots__ = (
        "_deadlines",
        "_line",
        "_numbers",
        "_timer",
        "in_turn",
        "lane",
        "lanes_waiting",
        "users",
        "waiting",
    )

    def __init__(self, lane: str, lanes_waiting: Counter[str]) -> None:
        self.lane = lane
        self.lanes_waiting = lanes_waiting
        self.users = 0
        self.waiting = 0
        self.in_turn = 0
        self._line: deque[asyncio.Future[bool]] = deque()  # oldest first; done ones are skipped
        # (deadline, number, waiter), soonest first: deadlines differ by caller, so a heap, not the line.
        self._deadlines: list[tuple[float, int, asyncio.Future[bool]]] = []
        self._numbers = itertools.count()
        self._timer: asyncio.TimerHandle | None = None

    async def enter(self, limit: int, *, timeout_s: float | None) -> bool:
        """Whether a turn was had within ``timeout_s`` (None: waits for it), ``limit`` under way at once.
        One had must be given back with :meth:`leave`."""
        if self.in_turn < limit:
            self._give(limit)  # to those ahead first (the limit may have risen since they came)
            if self.in_turn < limit:  # most deliveries: at once, nothing allocated
                self.in_turn += 1
                return True
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._line.append(waiter)
        if timeout_s is not None:
            heapq.heappush(self._deadlines, (loop.time() + timeout_s, next(self._numbers), waiter))
            if self._timer is None or self._deadlines[0][2] is waiter:
                self._arm(loop)
        self.waiting += 1
        self.lanes_waiting[self.lane] += 1
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self.leave(limit)  # given a turn as it was cancelled: the next in line has it
            raise
        finally:
            self.waiting -= 1
            self.lanes_waiting[self.lane] -= 1
            if not self.lanes_waiting[self.lane]:
                del self.lanes_waiting[self.lane]

    def leave(self, limit: int) -> None:
        """A turn given back: to the next in line, or to as many as ``limit`` now has room for."""
        self.in_turn -= 1
        self._give(limit)

    def _give(self, limit: int) -> None:
        while self._line and self.in_turn < limit:
            waiter = self._line.popleft()
            if not waiter.done():
                waiter.set_result(True)
                self.in_turn += 1

    def close(self) -> None:
        """Dropped with its last user: the timer goes (it could only find deadlines of copies gone)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._deadlines and self._deadlines[0][2].done():  # had their turn, or were cancelled
            heapq.heappop(self._deadlines)
        if self._deadlines:
            self._timer = loop.call_at(self._deadlines[0][0], self._expire, loop)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        while self._deadlines and self._deadlines[0][0] <= now:
            waiter = heapq.heappop(self._deadlines)[2]
            if not waiter.done():
                waiter.set_result(False)  # still in the line, done: skipped when turns are given
        self._arm(loop)
