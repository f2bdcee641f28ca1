"""The loop-lag probe tells its listeners how late each tick was (the admission's crowded loop), and logs
a stall with what the loop's thread did meanwhile."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hookline.dispatcher.lag import LATE_LOGGED_S, LagProbe, why_late


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


@pytest.mark.parametrize(
    ("elapsed_s", "ran_s", "waited_s", "cause"),
    [
        (0.40, 0.05, 0.33, "waited_for_cpu"),  # the burst's neighbours late: the broker had the cores
        (0.40, 0.36, 0.02, "ran"),  # this replica's own work: another replica helps
        (0.40, 0.01, 0.01, "blocked"),  # a call that waited on the disk
        (0.20, 0.10, 0.10, "ran"),  # a tie goes to the work in hand
    ],
)
def test_why_a_tick_was_late(elapsed_s: float, ran_s: float, waited_s: float, cause: str) -> None:
    assert why_late(elapsed_s=elapsed_s, ran_s=ran_s, waited_s=waited_s) == cause


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="Linux schedstat only")
async def test_a_loop_held_by_a_blocking_call_is_logged_once_as_blocked() -> None:
    ticked = asyncio.Event()
    async with LagProbe(tick_s=0.01) as probe:
        probe.listen(lambda late_s: ticked.set())
        await asyncio.wait_for(ticked.wait(), 5)
        with capture_logs() as logs:
            for _ in range(2):
                ticked.clear()
                time.sleep(LATE_LOGGED_S * 1.5)  # noqa: ASYNC251 (the subject: a call that blocks)
                await asyncio.wait_for(ticked.wait(), 5)
    late = [entry for entry in logs if entry["event"] == "loop_ran_late"]
    assert len(late) == 1, late  # the second stall within LOGGED_EVERY_S is not logged again
    assert late[0]["cause"] == "blocked", late
    assert late[0]["late_ms"] >= LATE_LOGGED_S * 1000 * 1.2, late
