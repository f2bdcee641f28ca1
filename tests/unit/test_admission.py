"""Admission of delivery attempts: the ledger's rules as tables (time passed in), and the waiting line
with a clock of the test's own."""

from __future__ import annotations

import asyncio

import pytest

from hookline.dispatcher.admission import (
    CROWDED_IN_FLIGHT,
    CROWDED_LATE_S,
    FORGET_AFTER_S,
    Admission,
    Ended,
    Ledger,
    Share,
    Standing,
    Ticket,
)

SLOW_AFTER_S = 2.0


def ledger(slots: int = 8, slow_slots: int = 2) -> Ledger:
    return Ledger(slots=slots, slow_slots=slow_slots, slow_after_s=SLOW_AFTER_S)


def answered(book: Ledger, endpoint_id: str, *, took_s: float, at_s: float = 0.0) -> None:
    ticket = book.start(endpoint_id, now_s=at_s)
    assert ticket is not None
    book.end(ticket, Ended.ANSWERED, now_s=at_s + took_s)


@pytest.mark.parametrize(
    ("answers_s", "standing"),
    [
        ([], Standing.NEW),
        ([0.01], Standing.ANSWERING),
        ([1.99], Standing.ANSWERING),
        ([2.0], Standing.SLOW),
        ([8.0], Standing.SLOW),
        ([8.0, 0.01], Standing.ANSWERING),  # one answer in time is enough to answer again
        ([0.01, 8.0], Standing.SLOW),
    ],
)
def test_an_endpoint_stands_by_how_long_its_last_answer_took(
    answers_s: list[float], standing: Standing
) -> None:
    book = ledger()
    for n, took_s in enumerate(answers_s):
        answered(book, "ep", took_s=took_s, at_s=n * 10.0)
    assert book.standing("ep") is standing


@pytest.mark.parametrize(
    ("ended", "took_s", "standing"),
    [
        (Ended.ANSWERED, 0.5, Standing.ANSWERING),
        (Ended.TIMED_OUT, 0.5, Standing.SLOW),  # a 1 s timeout under the 2 s line: still slow
        (Ended.NOT_SENT, 0.0, Standing.NEW),  # let go before the request: it says nothing of the endpoint
    ],
)
def test_how_an_attempt_ended_decides_the_standing(ended: Ended, took_s: float, standing: Standing) -> None:
    book = ledger()
    ticket = book.start("ep", now_s=0.0)
    assert ticket is not None
    book.end(ticket, ended, now_s=took_s)
    assert book.standing("ep") is standing
    assert book.in_use == {Share.ANSWERING: 0, Share.SLOW: 0}


def test_a_new_endpoint_has_one_attempt_at_a_time_until_it_answers() -> None:
    book = ledger()
    first = book.start("ep", now_s=0.0)
    assert first is not None
    assert first.share is Share.ANSWERING
    assert book.start("ep", now_s=0.0) is None, "probation: one attempt out"
    assert book.start("other", now_s=0.0) is not None, "only that endpoint waits"
    book.end(first, Ended.ANSWERED, now_s=0.01)
    assert [book.start("ep", now_s=0.02) is not None for _ in range(3)] == [True] * 3


@pytest.mark.parametrize(
    ("held", "holds_more"),
    [
        ({"ep": 1}, False),  # alone: all it holds is its share
        ({"ep": 3, "a": 3}, False),  # alike: a busy replica, nobody hogging
        ({"ep": 1, "a": 2, "b": 3}, False),
        ({"ep": 4, "a": 1}, False),  # two endpoints: twice an even share is all of them
        ({"ep": 4, "a": 1, "b": 1}, False),  # twice the even share (2 of 6), not more
        ({"ep": 6, "a": 1, "b": 1}, True),  # 6 of 8 between three
        ({"ep": 8, **{f"e{n}": 1 for n in range(8)}}, True),  # a burst among endpoints with one each
        ({"ep": 0, "a": 6}, False),  # none of them
    ],
)
def test_an_endpoint_holds_more_than_its_share_of_the_slots_in_use(
    held: dict[str, int], holds_more: bool
) -> None:
    book = ledger(slots=24, slow_slots=2)
    for endpoint_id, count in held.items():
        answered(book, endpoint_id, took_s=0.01)  # heard from: no probation
        for _ in range(count):
            assert book.start(endpoint_id, now_s=1.0) is not None
    assert book.busy == sum(1 for count in held.values() if count)
    assert book.holds_more_than_its_share("ep") is holds_more


def test_slow_endpoints_start_attempts_only_in_their_share() -> None:
    book = ledger(slots=8, slow_slots=2)
    for n in range(3):
        answered(book, f"slow{n}", took_s=8.0)
        answered(book, f"fast{n}", took_s=0.01)
    slow = [book.start(f"slow{n % 3}", now_s=20.0) for n in range(5)]
    assert [ticket is not None for ticket in slow] == [True, True, False, False, False]
    assert {ticket.share for ticket in slow if ticket} == {Share.SLOW}
    fast = [book.start(f"fast{n % 3}", now_s=20.0) for n in range(7)]
    assert [ticket is not None for ticket in fast] == [True] * 6 + [False], "six slots kept for them"
    assert book.in_use == {Share.ANSWERING: 6, Share.SLOW: 2}


def test_an_attempt_that_waits_too_long_frees_its_answering_slot_and_makes_its_endpoint_slow() -> None:
    book = ledger(slots=8, slow_slots=2)
    answered(book, "ep", took_s=0.01)
    hanging = [book.start("ep", now_s=10.0) for _ in range(4)]
    assert all(ticket is not None and ticket.share is Share.ANSWERING for ticket in hanging)
    assert book.next_aging_s() == 10.0 + SLOW_AFTER_S
    book.age(now_s=11.99)
    assert book.standing("ep") is Standing.ANSWERING
    book.age(now_s=12.0)
    assert book.standing("ep") is Standing.SLOW
    assert book.slow_count == 1
    # Over the slow share's size (attempts already under way), and the answering share is free again.
    assert book.in_use == {Share.ANSWERING: 0, Share.SLOW: 4}
    assert book.start("ep", now_s=12.0) is None, "the slow share is full"
    assert book.start("other", now_s=12.0) is not None
    for ticket in hanging[:3]:
        assert ticket is not None
        book.end(ticket, Ended.ANSWERED, now_s=13.0)
        assert book.standing("ep") is Standing.SLOW, "still slow: one of its attempts still waits"
    last = hanging[3]
    assert last is not None
    book.end(last, Ended.ANSWERED, now_s=13.0)
    assert book.standing("ep") is Standing.SLOW, "and its last answer took 3 s"
    answered(book, "ep", took_s=0.01, at_s=14.0)
    assert book.standing("ep") is Standing.ANSWERING
    assert book.slow_count == 0


def test_a_crowd_of_new_endpoints_that_hang_holds_one_answering_slot_each_until_they_are_slow() -> None:
    book = ledger(slots=8, slow_slots=2)
    hanging = [book.start(f"new{n}", now_s=0.0) for n in range(4)]
    assert all(ticket is not None for ticket in hanging)
    assert [book.start(f"new{n}", now_s=0.0) for n in range(4)] == [None] * 4
    assert book.start("healthy", now_s=0.0) is not None, "two answering slots left"
    book.age(now_s=SLOW_AFTER_S)
    assert book.in_use[Share.ANSWERING] == 0
    assert book.slow_count == 5


def test_idle_endpoints_are_forgotten() -> None:
    book = ledger()
    answered(book, "ep", took_s=8.0)
    assert book.slow_count == 1
    book.age(now_s=FORGET_AFTER_S + 8.0)
    assert book.standing("ep") is Standing.NEW
    assert book.slow_count == 0


@pytest.mark.parametrize(
    ("slow_endpoints", "prefetch"),
    [(0, 128), (1, 128), (2, 64), (3, 32), (4, 32), (5, 16), (100, 1), (127, 1), (128, 1), (1000, 1)],
)
def test_a_slow_endpoint_holds_its_part_of_the_slow_share(slow_endpoints: int, prefetch: int) -> None:
    book = Ledger(slots=512, slow_slots=128, slow_after_s=SLOW_AFTER_S)
    for n in range(slow_endpoints):
        answered(book, f"slow{n}", took_s=8.0)
    assert book.slow_prefetch() == prefetch


@pytest.mark.parametrize(
    ("answer_s", "in_flight", "crowded", "room"),
    [
        (None, 0, False, 1),  # new: one attempt, until it answers
        (None, 1, False, 0),
        (None, 0, True, 1),
        (0.01, 0, False, None),  # answering: no limit of its own (its prefetch and its share are)
        (0.01, 20, False, None),
        (0.01, 0, True, CROWDED_IN_FLIGHT),  # a crowded loop: so many at once
        (0.01, CROWDED_IN_FLIGHT - 1, True, 1),
        (0.01, CROWDED_IN_FLIGHT, True, 0),
        (8.0, 20, True, None),  # slow: it waits on the network, not the loop; the slow share bounds it
    ],
)
def test_what_an_endpoint_may_start_of_its_own(
    answer_s: float | None, in_flight: int, crowded: bool, room: int | None
) -> None:
    book = ledger(slots=64, slow_slots=32)
    if answer_s is not None:
        answered(book, "ep", took_s=answer_s)
    for _ in range(in_flight):
        assert book.start("ep", now_s=10.0) is not None
    book.crowded = crowded
    assert book.room("ep") == room
    assert (book.start("ep", now_s=10.0) is None) is (room == 0)


def test_the_shares_must_both_have_slots() -> None:
    with pytest.raises(ValueError, match="slow share"):
        Ledger(slots=4, slow_slots=4, slow_after_s=1.0)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


async def test_waiters_get_slots_in_turn_and_give_up_after_their_wait() -> None:
    admission = Admission(ledger(slots=4, slow_slots=1), clock=Clock())
    try:
        for name in ("a", "b", "c"):  # answering endpoints
            ticket = await admission.acquire(name, max_wait_s=1)
            assert ticket is not None
            admission.release(ticket, Ended.ANSWERED)
        held: list[Ticket] = []
        for name in ("a", "b", "c"):
            ticket = await admission.acquire(name, max_wait_s=1)
            assert ticket is not None
            held.append(ticket)
        waiting = [asyncio.ensure_future(admission.acquire(name, max_wait_s=5)) for name in ("a", "b")]
        await asyncio.sleep(0)
        assert not any(task.done() for task in waiting), "the three answering slots are taken"
        admission.release(held.pop(0), Ended.ANSWERED)
        first = await waiting[0]
        assert first is not None
        assert first.endpoint_id == "a", "first in line, first served"
        assert not waiting[1].done()
        assert await asyncio.wait_for(admission.acquire("c", max_wait_s=0.01), 1) is None, "gave up"
        admission.release(held.pop(0), Ended.ANSWERED)
        second = await waiting[1]
        assert second is not None
    finally:
        admission.close()


async def test_a_waiter_cancelled_after_its_turn_passes_the_turn_on() -> None:
    admission = Admission(ledger(slots=2, slow_slots=1), clock=Clock())
    try:
        warm = await admission.acquire("a", max_wait_s=1)
        assert warm is not None
        admission.release(warm, Ended.ANSWERED)
        held = await admission.acquire("a", max_wait_s=1)
        assert held is not None
        first = asyncio.ensure_future(admission.acquire("a", max_wait_s=5))
        second = asyncio.ensure_future(admission.acquire("a", max_wait_s=5))
        await asyncio.sleep(0)
        admission.release(held, Ended.ANSWERED)  # wakes the first...
        first.cancel()  # ...which is cancelled before it runs
        ticket = await asyncio.wait_for(second, 1)
        assert ticket is not None
        admission.release(ticket, Ended.ANSWERED)
    finally:
        admission.close()


async def test_once_a_new_endpoint_answers_all_its_waiting_deliveries_go() -> None:
    admission = Admission(ledger(slots=8, slow_slots=2), clock=Clock())
    try:
        first = await admission.acquire("new", max_wait_s=1)
        assert first is not None
        waiting = [asyncio.ensure_future(admission.acquire("new", max_wait_s=5)) for _ in range(3)]
        await asyncio.sleep(0)
        assert not any(task.done() for task in waiting), "on probation"
        admission.release(first, Ended.ANSWERED)
        tickets = await asyncio.wait_for(asyncio.gather(*waiting), 1)
        assert all(ticket is not None for ticket in tickets)
        assert admission.ledger.in_use[Share.ANSWERING] == 3
    finally:
        admission.close()


async def test_waiters_woken_together_on_probation_all_go_once_it_answers() -> None:
    """Three deliveries wait on probation; the attempt ends unsent, so all three are woken and one
    goes. The other two wait again, each in a line begun after the first was emptied: none may be left
    in a line nothing wakes (found by bench/burst.py: deliveries stuck for their whole wait, then put
    off for 30 s)."""
    admission = Admission(ledger(slots=8, slow_slots=2), clock=Clock())
    try:
        first = await admission.acquire("new", max_wait_s=1)
        assert first is not None
        waiting = [asyncio.ensure_future(admission.acquire("new", max_wait_s=5)) for _ in range(3)]
        await asyncio.sleep(0)
        admission.release(first, Ended.NOT_SENT)  # tells nothing: still on probation
        done, pending = await asyncio.wait(waiting, timeout=1, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "one goes, on probation again"
        assert len(pending) == 2
        second = done.pop().result()
        assert second is not None
        admission.release(second, Ended.ANSWERED)
        tickets = await asyncio.wait_for(asyncio.gather(*pending), 1)
        assert all(ticket is not None for ticket in tickets)
    finally:
        admission.close()


async def test_a_new_endpoint_with_nothing_out_waits_for_its_share_not_for_itself() -> None:
    """Its first delivery finds the answering share full: it is woken when a slot frees, not by an
    attempt of its own (it has none out)."""
    admission = Admission(ledger(slots=2, slow_slots=1), clock=Clock())
    try:
        held = await admission.acquire("busy", max_wait_s=1)
        assert held is not None
        first = asyncio.ensure_future(admission.acquire("new", max_wait_s=5))
        await asyncio.sleep(0)
        assert not first.done(), "the one answering slot is taken"
        admission.release(held, Ended.ANSWERED)
        ticket = await asyncio.wait_for(first, 1)
        assert ticket is not None
        assert ticket.endpoint_id == "new"
    finally:
        admission.close()


async def test_in_a_crowded_loop_an_endpoint_waits_for_its_own_attempts_and_goes_once_it_is_not() -> None:
    """Crowded: a fast endpoint's ninth delivery waits for one of its eight attempts to end (not for its
    share, which has room), while another endpoint starts at once; uncrowded, all its waiters go."""
    admission = Admission(ledger(slots=64, slow_slots=8), clock=Clock())
    try:
        for name in ("fast", "other"):
            warm = await admission.acquire(name, max_wait_s=1)
            assert warm is not None
            admission.release(warm, Ended.ANSWERED)
        admission.loop_ran_late(CROWDED_LATE_S)
        held = [await admission.acquire("fast", max_wait_s=1) for _ in range(CROWDED_IN_FLIGHT)]
        waiting = [asyncio.ensure_future(admission.acquire("fast", max_wait_s=5)) for _ in range(3)]
        await asyncio.sleep(0)
        assert not any(task.done() for task in waiting), "eight under way: the rest wait"
        assert await admission.acquire("other", max_wait_s=0.01) is not None, "only that endpoint waits"
        first = held.pop()
        assert first is not None
        admission.release(first, Ended.ANSWERED)
        done, pending = await asyncio.wait(waiting, timeout=1, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "one attempt ended: one more goes"
        admission.loop_ran_late(0.0)
        tickets = await asyncio.wait_for(asyncio.gather(*pending), 1)
        assert all(ticket is not None for ticket in tickets), "on time again: no limit of its own"
        assert admission.ledger.in_flight("fast") == CROWDED_IN_FLIGHT + 2
    finally:
        admission.close()
