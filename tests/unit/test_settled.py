"""What a dispatcher remembers of the messages it settled, for the broker's redeliveries."""

from __future__ import annotations

import pytest

from hookline.dispatcher.settled import Settled

KEY = ("ep", "evt_1", 1)


@pytest.mark.parametrize(
    ("asked", "after_s", "outcome"),
    [
        (KEY, 1.0, "delivered"),
        (KEY, 600.0, "delivered"),
        (KEY, 600.1, None),  # forgotten: a redelivery follows a lost connection by seconds
        (("ep", "evt_1", 2), 1.0, None),  # another attempt (a retry copy) is another message
        (("other", "evt_1", 1), 1.0, None),  # the same event at another endpoint
    ],
)
def test_a_settlement_is_found_by_endpoint_event_and_attempt(
    asked: tuple[str, str, int], after_s: float, outcome: str | None
) -> None:
    settled = Settled(keep_s=600.0)
    settled.add(KEY, "delivered", now_s=100.0)
    assert settled.outcome(asked, now_s=100.0 + after_s) == outcome


def test_it_keeps_the_newest_and_forgets_the_old() -> None:
    settled = Settled(keep_s=10.0, max_entries=3)
    for n in range(5):
        settled.add(("ep", f"e{n}", 1), "retry_scheduled", now_s=float(n))
    assert len(settled) == 3
    assert settled.outcome(("ep", "e0", 1), now_s=5.0) is None
    assert settled.outcome(("ep", "e4", 1), now_s=5.0) == "retry_scheduled"
    settled.add(("ep", "late", 1), "delivered", now_s=100.0)
    assert len(settled) == 1, "the rest expired"


@pytest.mark.parametrize(
    ("taken_straight", "settled", "expected"),
    [
        (True, None, "taken_straight"),  # the straight copy still under way, deferred or retrying
        (True, "delivered", "taken_straight"),
        (False, "delivered", "delivered"),  # taken before this replica remembered straight copies
        (False, None, None),  # came by the lane only (published before the binding): sent
    ],
)
def test_a_second_copy_is_not_sent_once_its_event_came_straight_or_was_settled(
    taken_straight: bool, settled: str | None, expected: str | None
) -> None:
    memory = Settled()
    if taken_straight:
        memory.took_straight("ep", "evt_1", now_s=1.0)
    if settled is not None:
        memory.add(KEY, settled, now_s=1.0)
    assert memory.second_copy(KEY, now_s=2.0) == expected
    assert memory.outcome(KEY, now_s=2.0) == settled, "a redelivery of the straight copy is still sent"
    assert memory.second_copy(("other", "evt_1", 1), now_s=2.0) is None
