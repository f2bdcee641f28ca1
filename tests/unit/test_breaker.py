"""The breaker's state machine as tables: closed → open → half_open → closed, or open again, doubled."""

from __future__ import annotations

from functools import reduce

import pytest

from hookline.health_monitor.breaker import Breaker, BreakerPolicy, BreakerState, open_for_s, record, tick

POLICY = BreakerPolicy(failure_threshold=3, cooldown_s=10, max_cooldown_s=35)
CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN

# Steps: ("ok"|"fail", at_s) records a result; ("tick", at_s) lets time pass.
Step = tuple[str, float]


def run(steps: list[Step], threshold: int = 3) -> Breaker:
    def step(breaker: Breaker, item: Step) -> Breaker:
        kind, at_s = item
        if kind == "tick":
            return tick(breaker, now_s=at_s)
        return record(breaker, success=kind == "ok", now_s=at_s, policy=POLICY, threshold=threshold)

    return reduce(step, steps, Breaker())


@pytest.mark.parametrize(
    ("steps", "state", "failures", "cooldown_s"),
    [
        ([], CLOSED, 0, 0),
        ([("fail", 1), ("fail", 2)], CLOSED, 2, 0),
        ([("fail", 1), ("fail", 2), ("ok", 3), ("fail", 4)], CLOSED, 1, 0),  # a success resets the count
        ([("fail", 1), ("fail", 2), ("fail", 3)], OPEN, 3, 10),
        ([("fail", 1), ("fail", 2), ("fail", 3), ("tick", 12.9)], OPEN, 3, 10),  # cooldown not over
        ([("fail", 1), ("fail", 2), ("fail", 3), ("tick", 13)], HALF, 3, 10),
        ([("fail", 1), ("fail", 2), ("fail", 3), ("ok", 4)], OPEN, 3, 10),  # late result while open: ignored
        ([("fail", 1), ("fail", 2), ("fail", 3), ("tick", 13), ("ok", 14)], CLOSED, 0, 0),  # probe succeeds
        ([("fail", 1), ("fail", 2), ("fail", 3), ("tick", 13), ("fail", 14)], OPEN, 3, 20),  # doubled
        (
            [("fail", 1), ("fail", 2), ("fail", 3), ("tick", 13), ("fail", 14), ("tick", 34), ("fail", 35)],
            OPEN,
            3,
            35,  # doubled again, but capped
        ),
        ([("fail", 1), ("fail", 2), ("fail", 3), ("tick", 13), ("fail", 14), ("tick", 33.9)], OPEN, 3, 20),
    ],
)
def test_transitions(steps: list[Step], state: BreakerState, failures: int, cooldown_s: float) -> None:
    breaker = run(steps)
    assert (breaker.state, breaker.consecutive_failures, breaker.cooldown_s) == (state, failures, cooldown_s)


def test_a_lower_threshold_opens_sooner() -> None:
    assert run([("fail", 1)], threshold=1).state is OPEN


def test_open_for_counts_from_the_first_opening_until_a_probe_succeeds() -> None:
    failing = run([("fail", 1), ("fail", 2), ("fail", 3), ("tick", 13), ("fail", 14)])
    assert open_for_s(failing, now_s=100) == 97
    recovered = run([("fail", 1), ("fail", 2), ("fail", 3), ("tick", 13), ("ok", 14)])
    assert open_for_s(recovered, now_s=100) == 0
