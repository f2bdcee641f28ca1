"""Which endpoints get series of their own in ``/metrics``.

A series per endpoint with traffic would be a million series on a large install, more than Prometheus
should scrape from one target. Kept: every endpoint that needs attention (a breaker not closed, events
waiting in a queue of its own, failures in the last five minutes), then the slowest by their 5-minute
p95, then the busiest by their 5-minute attempts, up to ``max_endpoints``
(``HOOKLINE_METRICS_MAX_ENDPOINTS``). Everything else is still in the aggregate series, the status API
and the dashboard.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Standing:
    """What the choice reads of one endpoint's health."""

    endpoint_id: str
    needs_attention: bool  # breaker not closed, a queue backlog, or recent failures
    p95_recent_ms: float | None
    attempts_recent: int


def chosen(standings: Iterable[Standing], *, max_endpoints: int) -> list[str]:
    """The endpoint ids to export, at most ``max_endpoints``: those needing attention first (in id
    order when even they are too many), then the slowest, then the busiest."""
    if max_endpoints <= 0:
        return []
    attention: list[str] = []
    others: list[Standing] = []
    for standing in standings:
        if standing.needs_attention:
            attention.append(standing.endpoint_id)
        else:
            others.append(standing)
    if len(attention) >= max_endpoints:
        return sorted(attention)[:max_endpoints]
    room = max_endpoints - len(attention)
    slowest = heapq.nlargest(
        (room + 1) // 2,
        (s for s in others if s.p95_recent_ms is not None),
        key=lambda s: (s.p95_recent_ms, s.endpoint_id),
    )
    picked = {s.endpoint_id for s in slowest}
    busiest = heapq.nlargest(
        room - len(picked),
        (s for s in others if s.endpoint_id not in picked),
        key=lambda s: (s.attempts_recent, s.endpoint_id),
    )
    return [*attention, *(s.endpoint_id for s in slowest), *(s.endpoint_id for s in busiest)]
