"""Which endpoints get series of their own in /metrics (health-monitor/series.py): a table."""

from __future__ import annotations

import pytest

from hookline.health_monitor.series import Standing, chosen


def quiet(endpoint_id: str, *, p95_ms: float | None = None, attempts: int = 0) -> Standing:
    return Standing(endpoint_id, needs_attention=False, p95_recent_ms=p95_ms, attempts_recent=attempts)


def troubled(endpoint_id: str) -> Standing:
    return Standing(endpoint_id, needs_attention=True, p95_recent_ms=None, attempts_recent=0)


@pytest.mark.parametrize(
    ("standings", "max_endpoints", "expected"),
    [
        pytest.param([], 10, [], id="nothing"),
        pytest.param([quiet("a"), troubled("b")], 0, [], id="none wanted"),
        pytest.param([quiet("a"), quiet("b")], 10, ["b", "a"], id="room for all"),
        pytest.param(
            [troubled("z"), quiet("a", p95_ms=900, attempts=1), quiet("b", attempts=50)],
            2,
            ["z", "a"],
            id="attention first, then the slowest",
        ),
        pytest.param(
            [troubled("c"), troubled("a"), troubled("b"), quiet("d", attempts=99)],
            2,
            ["a", "b"],
            id="too many needing attention: in id order",
        ),
        pytest.param(
            [
                quiet("slow", p95_ms=3000),
                quiet("slower", p95_ms=5000),
                quiet("busy", attempts=500),
                quiet("idle", attempts=1),
                quiet("busier", attempts=900),
            ],
            4,
            ["slower", "slow", "busier", "busy"],
            id="half the room the slowest, half the busiest",
        ),
        pytest.param(
            [quiet("fast", p95_ms=10, attempts=1000), quiet("busy", attempts=500), quiet("idle")],
            2,
            ["fast", "busy"],
            id="one slowest, then the busiest of the rest",
        ),
        pytest.param(
            [quiet("a", p95_ms=100), quiet("b", p95_ms=200)],
            3,
            ["b", "a"],
            id="no busiest left after the slowest",
        ),
    ],
)
def test_chosen(standings: list[Standing], max_endpoints: int, expected: list[str]) -> None:
    assert chosen(standings, max_endpoints=max_endpoints) == expected


def test_a_million_quiet_endpoints_give_the_bound() -> None:
    standings = [quiet(f"ep_{n:07d}", attempts=n % 100) for n in range(1_000_000)]
    picked = chosen(standings, max_endpoints=500)
    assert len(picked) == len(set(picked)) == 500
    assert all(int(endpoint_id[3:]) % 100 == 99 for endpoint_id in picked), "the busiest"
