"""The loop-lag probe tells its listeners how late each tick was (the admission's crowded loop)."""

from __future__ import annotations

import asyncio
import time

from hookline.dispatcher.lag import LagProbe


async def test_a_tick_kept_waiting_by_a_busy_loop_is_told_as_late() -> None:
    heard: list[float] = []
    ticked = asyncio.Event()

    def listener(late_s: float) -> None:
        heard.append(late_s)
        ticked.set()

    async with LagProbe(tick_s=0.01) as probe:
        probe.listen(listener)
        await asyncio.wait_for(ticked.wait(), 5)
        ticked.clear()
        before = len(heard)
        time.sleep(0.05)  # noqa: ASYNC251 (the subject: the loop held as a burst of work holds it)
        await asyncio.wait_for(ticked.wait(), 5)
    # The tick due within 10 ms of the sleep's start fired after it: 40 ms late at least.
    assert heard[before] >= 0.03, heard
