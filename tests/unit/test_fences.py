"""What a fence out of an endpoint's lane means, from the replica's view of the endpoint (a table: no I/O)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from support.factories import stored_endpoint

from hookline.dispatcher import fences
from hookline.dispatcher.fences import Verdict
from hookline.shared.contracts.models import StoredEndpoint

AT = datetime(2026, 12, 5, tzinfo=UTC)
LEAVING = stored_endpoint(ordered=True, straight=True, lane_fence="fence_a", version=4)
LEFT = stored_endpoint(ordered=True, straight=True, laned=False, left_lane_at=AT, version=5)
LANED = stored_endpoint(version=3)


@pytest.mark.parametrize(
    ("endpoint", "deleting", "fence_id", "fence_version", "expected"),
    [
        (None, True, "fence_d", None, Verdict.DRAINED),  # a deletion's fence: the deletion known
        (None, False, "fence_d", None, Verdict.STALE),  # drained already
        (LANED, False, "fence_d", None, Verdict.EARLY),  # the deletion not read yet
        (None, True, "fence_a", 4, Verdict.STALE),  # deleted while leaving: its deletion's fence drains it
        (None, False, "fence_a", 4, Verdict.STALE),
        (LEAVING, False, "fence_a", 4, Verdict.LEFT),
        (LEAVING.model_copy(update={"version": 6}), False, "fence_a", 4, Verdict.LEFT),  # edited since
        (LANED, False, "fence_a", 4, Verdict.EARLY),  # made ordered: not read yet
        (LEFT, False, "fence_a", 4, Verdict.STALE),  # a fence sent twice: left already
        (LANED.model_copy(update={"version": 7}), False, "fence_a", 4, Verdict.STALE),  # ordered, then not
        (
            LEAVING.model_copy(update={"version": 9, "lane_fence": "fence_b"}),
            False,
            "fence_a",
            4,
            Verdict.STALE,
        ),
        (
            LEAVING.model_copy(update={"version": 3, "lane_fence": "fence_b"}),
            False,
            "fence_a",
            4,
            Verdict.EARLY,
        ),
    ],
)
def test_a_fence_verdict(
    endpoint: StoredEndpoint | None,
    deleting: bool,
    fence_id: str,
    fence_version: int | None,
    expected: Verdict,
) -> None:
    assert (
        fences.verdict(endpoint, deleting=deleting, fence_id=fence_id, fence_version=fence_version)
        is expected
    )


def test_an_endpoint_leaves_its_lane_only_for_its_own_fence() -> None:
    left = fences.left(LEAVING, fence_id="fence_a", at=AT)
    assert left is not None
    assert (left.laned, left.straight, left.lane_fence, left.left_lane_at) == (False, True, None, AT)
    assert fences.left(LEAVING, fence_id="fence_b", at=AT) is None
    assert fences.left(left, fence_id="fence_a", at=AT) is None
    assert fences.left(LANED, fence_id="fence_a", at=AT) is None


STRAIGHT_FROM_THE_START = stored_endpoint(ordered=True, straight=True, laned=False, version=1)


@pytest.mark.parametrize(
    ("endpoint", "now", "expected"),
    [
        (LEAVING, AT, True),  # bound to events while its lane still fans it out
        (LEFT, AT + timedelta(hours=23), True),  # a lane message given out again may still copy it
        (LEFT, AT + fences.SECOND_COPIES_FOR, False),
        (STRAIGHT_FROM_THE_START, AT, False),  # never on a lane: no copy comes that way
        (LANED, AT, False),  # on its lane only: nothing comes straight
    ],
)
def test_second_copies_come_while_an_endpoint_leaves_its_lane_and_a_day_after(
    endpoint: StoredEndpoint, now: datetime, expected: bool
) -> None:
    assert fences.second_copies_may_come(endpoint, now=now) is expected
