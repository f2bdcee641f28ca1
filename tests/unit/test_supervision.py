"""The supervisor keeps every background loop running: a loop that fails, returns or stalls is started
again, and ``problems()`` (what ``/readyz`` shows) names a required loop for as long as it is not up.

Real asyncio with small real times: the pause before a restart and the stall watch are shrunk from
0.5 s / 1 s to 0.05 s so that each test takes well under a second.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from support.waiting import eventually

from hookline.shared.runtime import supervision
from hookline.shared.runtime.supervision import Loop, Supervisor


@pytest.fixture
async def supervisor(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Supervisor]:
    monkeypatch.setattr(supervision, "_FIRST_PAUSE_S", 0.05)
    monkeypatch.setattr(supervision, "_WATCH_INTERVAL_S", 0.05)
    running = Supervisor()
    yield running
    await running.stop(timeout_s=2)


async def until(check: Callable[[], bool], timeout_s: float = 1.5) -> None:
    async def probe() -> bool:
        return check()

    await eventually(probe, timeout_s=timeout_s, every_s=0.01)


async def test_a_loop_that_raises_is_restarted_and_reported_while_down(supervisor: Supervisor) -> None:
    runs = 0
    back = asyncio.Event()

    async def flaky(loop: Loop) -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            loop.mark_up()
            raise RuntimeError("boom")
        await back.wait()  # the second run takes its time to be established
        loop.mark_up()
        await asyncio.Event().wait()

    loop = supervisor.spawn("flaky", flaky)
    await until(lambda: runs == 2)
    assert loop.restarts == 1
    assert supervisor.problems() == ["flaky: down (RuntimeError: boom)"]
    assert not supervisor.ready()

    back.set()
    await until(lambda: loop.up)
    assert supervisor.problems() == []
    assert supervisor.ready()
    assert (runs, loop.restarts) == (2, 1)


async def test_a_loop_that_is_not_required_never_makes_the_service_unready(supervisor: Supervisor) -> None:
    async def failing(loop: Loop) -> None:
        raise OSError("unreachable")

    loop = supervisor.spawn("optional", failing, required=False)
    await until(lambda: loop.restarts >= 2)
    assert loop.last_error == "OSError: unreachable"
    assert supervisor.problems() == []


async def test_a_loop_that_stops_beating_is_cancelled_and_restarted(supervisor: Supervisor) -> None:
    runs = beats = 0
    cancelled = asyncio.Event()
    let_go = asyncio.Event()

    async def hanging(loop: Loop) -> None:
        nonlocal runs, beats
        runs += 1
        loop.mark_up()
        if runs == 1:
            try:
                await asyncio.Event().wait()  # hung: never beats again
            except asyncio.CancelledError:
                cancelled.set()
                await let_go.wait()  # holds the restart back so the test can look at the stall
                raise
        while True:
            loop.beat()
            beats += 1
            await asyncio.sleep(0.02)

    loop = supervisor.spawn("hanging", hanging, stall_s=0.2)
    async with asyncio.timeout(1.5):
        await cancelled.wait()
    assert supervisor.problems() == ["hanging: stalled"], "up, but not making progress"
    assert loop.restarts == 0

    let_go.set()
    await until(lambda: runs == 2 and loop.up)
    assert (loop.restarts, loop.last_error) == (1, "stalled")
    # The second run beats: it stays up well past stall_s (20 beats of 20 ms: twice stall_s).
    await until(lambda: beats >= 20)
    assert (runs, loop.restarts) == (2, 1)
    assert supervisor.problems() == []


async def test_a_loop_that_returns_is_restarted(supervisor: Supervisor) -> None:
    runs = 0

    async def once(loop: Loop) -> None:
        nonlocal runs
        runs += 1
        loop.mark_up()

    loop = supervisor.spawn("once", once)
    await until(lambda: runs >= 2)
    assert loop.restarts >= 1
    assert loop.last_error == "returned"


async def test_wait_up_returns_once_the_loop_is_established(supervisor: Supervisor) -> None:
    subscribed = asyncio.Event()

    async def follower(loop: Loop) -> None:
        await subscribed.wait()
        loop.mark_up()
        await asyncio.Event().wait()

    supervisor.spawn("follower", follower)
    with pytest.raises(TimeoutError):
        await supervisor.wait_up("follower", timeout_s=0.1)
    assert supervisor.problems() == ["follower: down"]

    subscribed.set()
    await supervisor.wait_up("follower", timeout_s=1)
    assert supervisor.ready()


async def test_stop_cancels_the_named_loop_for_good(supervisor: Supervisor) -> None:
    runs = {"stopped": 0, "kept": 0}
    ended = asyncio.Event()

    def body(name: str) -> supervision.Body:
        async def run(loop: Loop) -> None:
            runs[name] += 1
            loop.mark_up()
            try:
                await asyncio.Event().wait()
            finally:
                if name == "stopped":
                    ended.set()

        return run

    stopped = supervisor.spawn("stopped", body("stopped"))
    kept = supervisor.spawn("kept", body("kept"))
    await supervisor.wait_up("stopped", "kept", timeout_s=1)

    await supervisor.stop("stopped", timeout_s=1)
    assert ended.is_set(), "the body was cancelled, and waited for"
    assert (stopped.up, stopped.last_error, stopped.restarts) == (False, "stopped", 0)
    assert supervisor.problems() == ["stopped: down (stopped)"]
    assert kept.up

    # Sentinel: another loop fails and is restarted three times meanwhile; the stopped one never is.
    async def failing(loop: Loop) -> None:
        raise RuntimeError("again")

    sentinel = supervisor.spawn("sentinel", failing, required=False)
    await until(lambda: sentinel.restarts >= 3)
    assert runs == {"stopped": 1, "kept": 1}

    await supervisor.stop(timeout_s=1)
    assert not kept.up
    assert sorted(supervisor.problems()) == ["kept: down (stopped)", "stopped: down (stopped)"]
    assert sentinel.last_error == "stopped"
