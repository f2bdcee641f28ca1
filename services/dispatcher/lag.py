"""How late the dispatcher's event loop runs: a timer every ``TICK_S``, and how long after its time it
fired, in ``hookline_dispatcher_loop_late_seconds``.

That is how long anything ready in the process waited for the loop then — every attempt, ack and lane
message. Unloaded it is a fraction of a millisecond; tens of milliseconds say the dispatcher is short
of CPU (more replicas, or fewer on this machine), and a delivery that is late while this is not was late
before it reached the process (the broker, or the connection: see ``_unbounded_frames`` in
:mod:`hookline.shared.amqp`, found that way).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

from hookline.dispatcher import metrics

TICK_S = 0.05


class LagProbe:
    """Owns the timer."""

    def __init__(self, *, tick_s: float = TICK_S) -> None:
        self._tick_s = tick_s
        self._timer: asyncio.TimerHandle | None = None
        self._due_s = 0.0
        self._listeners: list[Callable[[float], None]] = []

    def listen(self, listener: Callable[[float], None]) -> None:
        """Have ``listener`` told how late each tick was (the admission's crowded loop)."""
        self._listeners.append(listener)

    async def __aenter__(self) -> LagProbe:
        self._schedule(asyncio.get_running_loop())
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        self._due_s = loop.time() + self._tick_s
        self._timer = loop.call_at(self._due_s, self._tick)

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        late_s = max(0.0, loop.time() - self._due_s)
        metrics.LOOP_LATE_SECONDS.observe(late_s)
        for listener in self._listeners:
            listener(late_s)
        self._schedule(loop)
