"""A service's long-running loops, kept running: restarted when they fail or stall, and reported to ``/readyz``.

Every background loop of every service (stream followers, consumers, the monitor's tick, telemetry,
queue polling...) runs under a :class:`Supervisor`. A loop body is a coroutine that runs until it
fails; it says when it is established (``loop.mark_up()``: subscribed, caught up) and, if it should
make progress on its own, beats (``loop.beat()``). The supervisor restarts a body that raised or
returned, after a pause that grows while it keeps failing, and cancels and restarts one that stopped
beating for ``stall_s``: a loop hung on a broker that never answers is as bad as a dead one. The
service is ready only while every required loop is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import prometheus_client
import structlog

log = structlog.get_logger(__name__)

LOOP_UP = prometheus_client.Gauge("hookline_loop_up", "1 while a background loop is running.", ["loop"])
LOOP_RESTARTS = prometheus_client.Counter(
    "hookline_loop_restarts", "Times a background loop failed or stalled and was started again.", ["loop"]
)

_FIRST_PAUSE_S = 0.5
_MAX_PAUSE_S = 10.0
#: A loop that ran this long before failing starts its next pause from the first one again.
_HEALTHY_RUN_S = 30.0
_WATCH_INTERVAL_S = 1.0


@dataclass
class Loop:
    name: str
    required: bool
    stall_s: float | None
    up: bool = False
    restarts: int = 0
    last_error: str | None = None
    last_beat_s: float = field(default_factory=time.monotonic)
    established: asyncio.Event = field(default_factory=asyncio.Event)

    def mark_up(self) -> None:
        """The loop is established (subscribed, connected, caught up): the service may count on it."""
        self.up = True
        self.established.set()
        self.beat()
        LOOP_UP.labels(self.name).set(1)

    def beat(self) -> None:
        """The loop made progress; a loop with ``stall_s`` that does not beat in time is restarted."""
        self.last_beat_s = time.monotonic()

    def stalled(self, now_s: float) -> bool:
        return self.stall_s is not None and now_s - self.last_beat_s > self.stall_s

    def _down(self, error: str | None) -> None:
        self.up = False
        self.established.clear()
        self.last_error = error
        LOOP_UP.labels(self.name).set(0)


Body = Callable[[Loop], Awaitable[None]]


class Supervisor:
    def __init__(self) -> None:
        self.loops: dict[str, Loop] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def spawn(self, name: str, body: Body, *, required: bool = True, stall_s: float | None = None) -> Loop:
        assert name not in self.loops, f"a loop named {name} already runs"
        loop = self.loops[name] = Loop(name, required, stall_s)
        LOOP_UP.labels(name).set(0)
        self._tasks[name] = asyncio.create_task(self._keep_running(loop, body), name=f"loop:{name}")
        return loop

    def problems(self) -> list[str]:
        """Why the service is not ready: each required loop that is not up, and why."""
        now_s = time.monotonic()
        return [
            f"{loop.name}: {'stalled' if loop.up else 'down'}"
            + (f" ({loop.last_error})" if loop.last_error and not loop.up else "")
            for loop in self.loops.values()
            if loop.required and (not loop.up or loop.stalled(now_s))
        ]

    def ready(self) -> bool:
        return not self.problems()

    async def wait_up(self, *names: str, timeout_s: float) -> None:
        """Wait until the named loops are up (at start: a service is not ready before its followers are)."""
        async with asyncio.timeout(timeout_s):
            for name in names:
                await self.loops[name].established.wait()

    async def stop(self, *names: str, timeout_s: float = 10.0) -> None:
        """Cancel the named loops (all, when none are named) and wait for them, within ``timeout_s``."""
        chosen = [self._tasks.pop(name) for name in (names or list(self._tasks)) if name in self._tasks]
        for task in chosen:
            task.cancel()
        if chosen:
            await asyncio.wait(chosen, timeout=timeout_s)
        for name in names or list(self.loops):
            if name in self.loops:
                self.loops[name]._down("stopped")

    async def _keep_running(self, loop: Loop, body: Body) -> None:
        pause_s = _FIRST_PAUSE_S
        while True:
            started_s = time.monotonic()
            loop.beat()
            error = await self._run_once(loop, body)
            loop._down(error)
            loop.restarts += 1
            LOOP_RESTARTS.labels(loop.name).inc()
            if time.monotonic() - started_s > _HEALTHY_RUN_S:
                pause_s = _FIRST_PAUSE_S
            log.warning("loop_restarting", loop=loop.name, error=error, restart_in_s=pause_s)
            await asyncio.sleep(pause_s)
            pause_s = min(pause_s * 2, _MAX_PAUSE_S)

    async def _run_once(self, loop: Loop, body: Body) -> str:
        """Run the body until it fails, returns or stalls; the reason, for the log and ``/readyz``."""
        task = asyncio.create_task(_call(body, loop), name=f"loop-body:{loop.name}")
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_WATCH_INTERVAL_S)
                if done:
                    break
                if loop.stalled(time.monotonic()):
                    log.error("loop_stalled", loop=loop.name, stall_s=loop.stall_s)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                    return "stalled"
        except asyncio.CancelledError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise
        if task.cancelled():
            return "cancelled"
        exc = task.exception()
        if exc is None:
            return "returned"
        log.warning("loop_failed", loop=loop.name, error=type(exc).__name__, detail=str(exc)[:300])
        return f"{type(exc).__name__}: {str(exc)[:120]}" if str(exc) else type(exc).__name__


async def _call(body: Body, loop: Loop) -> None:
    await body(loop)
