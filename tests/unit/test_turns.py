"""An endpoint's turns for deliveries from lanes (dispatcher/turns.py): a few at once, the rest in order,
a wait bounded by one timer, the number of turns given at each call."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import pytest
from support.waiting import eventually

from hookline.dispatcher.turns import Turns


async def _until(check: Callable[[], bool]) -> None:
    async def probe() -> bool:
        return check()

    await eventually(probe, every_s=0.001)


def _turns() -> tuple[Turns, Counter[str]]:
    lanes_waiting: Counter[str] = Counter()
    return Turns("hookline.lane.3", lanes_waiting), lanes_waiting


async def _waiting(turns: Turns, count: int) -> None:
    await _until(lambda: turns.waiting == count)


async def test_turns_past_the_limit_are_given_in_order_as_others_leave() -> None:
    turns, lanes_waiting = _turns()
    assert [await turns.enter(2, timeout_s=None) for _ in range(2)] == [True, True]
    had: list[int] = []

    async def wait(n: int) -> None:
        assert await turns.enter(2, timeout_s=None)
        had.append(n)

    waiters = [asyncio.create_task(wait(n)) for n in range(3)]
    await _waiting(turns, 3)
    assert lanes_waiting == Counter({"hookline.lane.3": 3})
    assert had == []
    turns.leave(2)
    await _until(lambda: had == [0])
    turns.leave(2)
    turns.leave(2)
    await asyncio.gather(*waiters)
    assert had == [0, 1, 2]
    assert turns.in_turn == 2
    assert not lanes_waiting


async def test_a_wait_past_its_timeout_is_told_so_while_the_others_keep_their_place() -> None:
    turns, lanes_waiting = _turns()
    assert await turns.enter(1, timeout_s=None)
    patient = asyncio.create_task(turns.enter(1, timeout_s=None))
    hasty = asyncio.create_task(turns.enter(1, timeout_s=0.01))
    assert await hasty is False  # the turn is still held
    assert not patient.done()
    assert turns.waiting == 1
    assert lanes_waiting["hookline.lane.3"] == 1
    turns.leave(1)
    assert await patient is True
    assert turns.in_turn == 1
    turns.leave(1)
    assert turns.in_turn == 0
    assert await turns.enter(1, timeout_s=None)  # the timed-out one left nothing in the line


async def test_the_soonest_deadline_expires_first_whatever_the_order_of_arrival() -> None:
    turns, _ = _turns()
    assert await turns.enter(1, timeout_s=None)
    later = asyncio.create_task(turns.enter(1, timeout_s=60))
    await _waiting(turns, 1)
    sooner = asyncio.create_task(turns.enter(1, timeout_s=0.01))
    assert await sooner is False
    assert not later.done()
    turns.leave(1)
    assert await later is True
    turns.leave(1)
    turns.close()


@pytest.mark.parametrize(
    ("entered_with", "left_with", "woken"),
    [
        (4, 4, 1),  # the turn left goes to the next in line
        (4, 2, 0),  # the limit fell (the loop runs late): the three still under way are over it
        (2, 4, 3),  # it rose: as many go as it has room for
    ],
)
async def test_the_limit_given_at_each_call_decides_how_many_go(
    entered_with: int, left_with: int, woken: int
) -> None:
    turns, _ = _turns()
    for _ in range(entered_with):
        assert await turns.enter(entered_with, timeout_s=None)
    waiters = [asyncio.create_task(turns.enter(entered_with, timeout_s=None)) for _ in range(3)]
    await _waiting(turns, 3)
    turns.leave(left_with)
    await _waiting(turns, 3 - woken)
    assert [w.done() for w in waiters] == [n < woken for n in range(3)]
    assert turns.in_turn == entered_with - 1 + woken
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


async def test_a_limit_risen_goes_to_those_ahead_before_a_newcomer() -> None:
    turns, _ = _turns()
    for _ in range(2):
        assert await turns.enter(2, timeout_s=None)
    ahead = [asyncio.create_task(turns.enter(2, timeout_s=None)) for _ in range(3)]
    await _waiting(turns, 3)
    newcomer = asyncio.create_task(turns.enter(4, timeout_s=None))
    await _waiting(turns, 2)  # two of those ahead went, the third and the newcomer wait
    assert [w.done() for w in ahead] == [True, True, False]
    assert not newcomer.done()
    turns.leave(4)
    assert await ahead[2] is True
    assert not newcomer.done()
    turns.leave(4)
    assert await newcomer is True


async def test_a_turn_given_to_a_waiter_cancelled_meanwhile_goes_to_the_next() -> None:
    turns, lanes_waiting = _turns()
    assert await turns.enter(1, timeout_s=None)
    first = asyncio.create_task(turns.enter(1, timeout_s=None))
    second = asyncio.create_task(turns.enter(1, timeout_s=None))
    await _waiting(turns, 2)
    turns.leave(1)  # the turn is the first's, which is cancelled before it runs again
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await second is True
    assert turns.in_turn == 1
    third = asyncio.create_task(turns.enter(1, timeout_s=None))
    await _waiting(turns, 1)
    third.cancel()  # cancelled while waiting: skipped, its place given to nobody
    with pytest.raises(asyncio.CancelledError):
        await third
    assert turns.in_turn == 1
    assert not lanes_waiting
    turns.leave(1)
    assert turns.in_turn == 0
