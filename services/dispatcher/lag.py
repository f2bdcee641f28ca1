"""How late the dispatcher's event loop runs: a timer every ``TICK_S``, and how long after its time it
fired, in ``hookline_dispatcher_loop_late_seconds``.

That is how long anything ready in the process waited for the loop then — every attempt, ack and lane
message. Unloaded it is a fraction of a millisecond; tens of milliseconds say the dispatcher is short
of CPU (more replicas, or fewer on this machine), and a delivery that is late while this is not was late
before it reached the process (the broker, or the connection: see ``_unbounded_frames`` in
:mod:`hookline.shared.broker.amqp`, found that way).

A tick ``LATE_LOGGED_S`` late or more is logged (``loop_ran_late``, at most every ``LOGGED_EVERY_S``)
with what the loop's thread did meanwhile (:func:`why_late`): it *ran* (too much work in this replica:
another replica helps), it *waited for a CPU* (other processes on the machine had the cores: a replica
more on the same cores does not help, CPU set aside for the dispatchers does), or neither: it was
*blocked* (a call that waited on the disk, or the process was stopped). The run-queue wait is also
counted whole in ``hookline_dispatcher_loop_cpu_wait_seconds_total`` (Linux, from the thread's
schedstat). Found so: a burst's neighbours in other lanes late by 250–400 ms on this 2-core machine
were, within a few milliseconds, the dispatcher's thread waiting for a CPU the broker and the burst's
publisher had (``docs/decisions.md``, "Late for want of a CPU").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Literal

import structlog

from hookline.dispatcher import metrics

log = structlog.get_logger()

TICK_S = 0.05
#: A tick this late is a stall a delivery feels (the line for another lane is 250 ms).
LATE_LOGGED_S = 0.1
#: One line for a stretch of late ticks, not twenty a second.
LOGGED_EVERY_S = 10.0

#: The loop's thread's scheduler statistics: time on a CPU, then time ready but waiting for one (ns).
_SCHEDSTAT = Path("/proc/thread-self/schedstat")

Cause = Literal["ran", "waited_for_cpu", "blocked"]


def why_late(*, elapsed_s: float, ran_s: float, waited_s: float) -> Cause:
    """What took most of ``elapsed_s`` (a tick's interval, its lateness included): running, waiting for
    a CPU, or neither (blocked)."""
    blocked_s = elapsed_s - ran_s - waited_s
    longest = max(ran_s, waited_s, blocked_s)
    return "ran" if longest == ran_s else "waited_for_cpu" if longest == waited_s else "blocked"


def _cpu_wait_s() -> float | None:
    """The thread's run-queue wait so far; None where the kernel does not tell it."""
    try:
        return int(_SCHEDSTAT.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class LagProbe:
    """Owns the timer."""

    def __init__(self, *, tick_s: float = TICK_S) -> None:
        self._tick_s = tick_s
        self._timer: asyncio.TimerHandle | None = None
        self._due_s = 0.0
        self._scheduled_s = 0.0
        self._ran_s = 0.0
        self._waited_s: float | None = None
        self._logged_at_s: float | None = None
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
        self._scheduled_s = loop.time()
        self._due_s = self._scheduled_s + self._tick_s
        self._ran_s = time.thread_time()
        self._timer = loop.call_at(self._due_s, self._tick)

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        now_s = loop.time()
        late_s = max(0.0, now_s - self._due_s)
        metrics.LOOP_LATE_SECONDS.observe(late_s)
        waited_s = _cpu_wait_s()
        waited_since_s = 0.0
        if waited_s is not None:
            waited_since_s = waited_s - (self._waited_s if self._waited_s is not None else waited_s)
            metrics.LOOP_CPU_WAIT_SECONDS.inc(max(0.0, waited_since_s))
            self._waited_s = waited_s
        if late_s >= LATE_LOGGED_S and (
            self._logged_at_s is None or now_s - self._logged_at_s >= LOGGED_EVERY_S
        ):
            self._logged_at_s = now_s
            ran_s = time.thread_time() - self._ran_s
            known = waited_s is not None  # without the wait, waiting and blocked look alike
            log.warning(
                "loop_ran_late", late_ms=round(late_s * 1000), ran_ms=round(ran_s * 1000),
                waited_for_cpu_ms=round(waited_since_s * 1000) if known else None,
                cause=why_late(elapsed_s=now_s - self._scheduled_s, ran_s=ran_s, waited_s=waited_since_s)
                if known else None,
            )  # fmt: skip
        for listener in self._listeners:
            listener(late_s)
        self._schedule(loop)
