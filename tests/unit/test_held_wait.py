"""How long a held endpoint's copy waits out its breaker in the delay queues: until the probe is due,
never less than the recheck (one queue write per wait, not a hand-back a second)."""

from __future__ import annotations

import pytest

from hookline.dispatcher.lanes import HELD_RECHECK_S, held_wait_s
from hookline.shared.contracts.control import BreakerCommand, BreakerState

NOW_S = 1_000_000.0


def _breaker(state: BreakerState, *, opened_ago_s: float | None, cooldown_s: float) -> BreakerCommand:
    return BreakerCommand(
        endpoint_id="ep_" + "1" * 26,
        state=state,
        version=1,
        opened_at_s=None if opened_ago_s is None else NOW_S - opened_ago_s,
        cooldown_s=cooldown_s,
    )


@pytest.mark.parametrize(
    ("state", "opened_ago_s", "cooldown_s", "wait_s"),
    [
        (BreakerState.OPEN, 0.0, 60.0, 60),  # just opened: the whole cooldown
        (BreakerState.OPEN, 20.0, 60.0, 40),
        (BreakerState.OPEN, 20.5, 60.0, 40),  # rounded up: never back before the probe is due
        (BreakerState.OPEN, 0.0, 3600.0, 3600),  # the longest cooldown, in one wait
        (BreakerState.OPEN, 58.0, 60.0, HELD_RECHECK_S),  # nearly due: the recheck at least
        (BreakerState.OPEN, 90.0, 60.0, HELD_RECHECK_S),  # overdue (the monitor has not half-opened it yet)
        (BreakerState.OPEN, None, 60.0, HELD_RECHECK_S),  # no time known
        (BreakerState.HALF_OPEN, 90.0, 60.0, HELD_RECHECK_S),  # probed with another copy meanwhile
    ],
)
def test_a_held_copy_waits_until_the_probe_is_due(
    state: BreakerState, opened_ago_s: float | None, cooldown_s: float, wait_s: int
) -> None:
    breaker = _breaker(state, opened_ago_s=opened_ago_s, cooldown_s=cooldown_s)
    assert held_wait_s(breaker, now_s=NOW_S) == wait_s
