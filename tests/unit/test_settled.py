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
