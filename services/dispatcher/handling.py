"""The handlings of consumed messages under way: tasks the shutdown drain waits for (a half-open probe's
too), counted per endpoint for heartbeats, and the messages held without an ack at the broker.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

from hookline.dispatcher.acks import Acks
from hookline.dispatcher.consumed import Incoming


class Handling:
    def __init__(self, acks: Acks) -> None:
        self._acks = acks
        self._tasks: set[asyncio.Task[None]] = set()
        self._unacked: Counter[str] = Counter()

    async def track(
        self,
        endpoint_id: str,
        handle: Callable[[Incoming], Awaitable[object]],
        message: Incoming,
    ) -> None:
        """Run a message's handling as a task the shutdown drain waits for, counted per endpoint."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._unacked[endpoint_id] += 1
        self._acks.delivered(message)
        try:
            await handle(message)
        finally:
            self._tasks.discard(task)
            self._unacked[endpoint_id] -= 1
            if not self._unacked[endpoint_id]:
                del self._unacked[endpoint_id]

    def add(self, task: asyncio.Task[None]) -> None:
        """A task of its own (a probe) the drain waits for too."""
        self._tasks.add(task)

    def discard(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def unacked(self) -> int:
        """Messages held without an ack at the broker: being handled, or settled with the ack to go."""
        return sum(self._unacked.values()) + self._acks.pending()

    def unacked_by_endpoint(self) -> Counter[str]:
        """Messages being handled per endpoint (not the lanes' own, counted under no endpoint)."""
        return Counter({key: n for key, n in self._unacked.items() if key})

    async def drain(self, grace_s: float) -> int:
        """Wait up to ``grace_s`` for in-flight deliveries; cancel the rest. Returns how many were cancelled.

        A cancelled delivery's message stays unacked, so the broker redelivers it when the channel closes.
        """
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        leftovers = set(self._tasks)
        for task in leftovers:
            task.cancel()
        if leftovers:
            await asyncio.wait(leftovers, timeout=5)
        return len(leftovers)
