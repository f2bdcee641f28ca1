"""When an endpoint whose lane deliveries wait for their turn is backlogged (given a queue of its own):
only when its waiting copies are most of what waits from its lane, so that the others wait behind it.
A load spread over a tenant's endpoints, or fanned out to all of them, isolates none (each would write
every event twice on a machine already short of time)."""

from __future__ import annotations

import pytest

from hookline.dispatcher.lanes import holds_its_lane

PER_ENDPOINT = 32


@pytest.mark.parametrize(
    ("waiting", "lane_waiting", "backlogged"),
    [
        (224, 230, True),  # a burst: nearly every waiting copy of the lane is its own
        (100, 150, True),  # most of them
        (60, 120, False),  # exactly half: two endpoints bursting alike wait for each other
        (23, 230, False),  # its tenth of ten endpoints' spread load
        (224, 224 * 20, False),  # one of twenty endpoints each event is fanned out to
        (31, 31, False),  # alone, but fewer than it may deliver at once: a moment's wait
        (32, 32, True),  # alone, as many as it may deliver at once waiting besides
    ],
)
def test_backlogged_only_when_it_holds_its_lane(waiting: int, lane_waiting: int, backlogged: bool) -> None:
    assert holds_its_lane(waiting, lane_waiting, per_endpoint=PER_ENDPOINT) is backlogged
