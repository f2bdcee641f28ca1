"""What a fence that came out of an endpoint's lane means, decided from the replica's view of the endpoint.

An ingest puts a fence in an endpoint's lane behind every lane message that may still owe the endpoint a
copy: after its deletion (until the fence passes, the fan-out keeps those copies as ``endpoint_gone``
dead letters), or after it was made ordered and its queue of its own bound to ``events`` (until the fence
passes, the fan-out still hands its lane copies on; those published since the binding are duplicates).
The queue gives a fence out only once every message before it has been given out, so when a dispatcher
takes one, the fan-out may stop counting the endpoint. A replica that takes a fence before it has read
the change that put it there puts it back in the lane for a second.
"""

from __future__ import annotations

import enum
from datetime import datetime, timedelta

from hookline.shared.contracts.models import StoredEndpoint

#: A lane message given out again may be fanned out this long after its endpoint left the lane
#: (fanout.REDELIVERY_COUNTS_DELETED counts those endpoints as long), so second copies may come as late.
SECOND_COPIES_FOR = timedelta(days=1)


class Verdict(enum.Enum):
    DRAINED = "drained"  # deleted: the fan-out stops counting it (EndpointDrained)
    LEFT = "left"  # leaving its lane: it leaves (``laned`` goes)
    EARLY = "early"  # taken before this replica read the change that put it there: back in the lane
    STALE = "stale"  # what it was put there for is done already, or undone by a later change: dropped


def verdict(
    endpoint: StoredEndpoint | None, *, deleting: bool, fence_id: str | None, fence_version: int | None
) -> Verdict:
    """``endpoint`` as this replica knows it (None: not a live endpoint), ``deleting`` whether it is
    deleted with its deletion's fence still to pass; ``fence_version`` the version a leaving fence was
    written for (None on a deletion's fence)."""
    if fence_version is None:  # a deletion's
        if deleting:
            return Verdict.DRAINED
        return Verdict.STALE if endpoint is None else Verdict.EARLY  # passed already / not read yet
    if endpoint is None:
        return Verdict.STALE  # deleted while leaving its lane: the deletion has a fence of its own
    if leaving(endpoint, fence_id):
        return Verdict.LEFT
    if endpoint.version < fence_version:
        return Verdict.EARLY
    return Verdict.STALE


def leaving(endpoint: StoredEndpoint, fence_id: str | None) -> bool:
    """Whether the endpoint is leaving its lane and waits for this fence."""
    return endpoint.straight and endpoint.laned and fence_id is not None and endpoint.lane_fence == fence_id


def left(endpoint: StoredEndpoint, *, fence_id: str | None, at: datetime) -> StoredEndpoint | None:
    """The endpoint once its lane has passed the fence (None: nothing to change any more), for
    :meth:`~hookline.shared.state.registry.ChangeLog.update`."""
    if not leaving(endpoint, fence_id):
        return None
    return endpoint.model_copy(update={"laned": False, "lane_fence": None, "left_lane_at": at})


def second_copies_may_come(endpoint: StoredEndpoint, *, now: datetime) -> bool:
    """Whether a lane may still hand this endpoint's events on as second copies: it is leaving its lane,
    or left it lately. Its queue's consumer then remembers the events that came to it straight."""
    if not endpoint.straight:
        return False
    if endpoint.laned:
        return True
    return endpoint.left_lane_at is not None and now - endpoint.left_lane_at < SECOND_COPIES_FOR
