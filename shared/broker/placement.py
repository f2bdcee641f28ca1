"""Whether an endpoint is delivered from its tenant's lane or from a queue of its own: one rule, pure.

An endpoint is *isolated* (has a queue of its own, to which the dispatchers' fan-out hands its copies)
for as long as one of these holds; otherwise it is delivered inline, from its lane:

- its options: ``rate_limit_per_s``, ``max_in_flight`` or ``ordered`` hold across replicas only through
  a queue with a single active consumer;
- its status: paused or disabled (its events wait in its queue, unconsumed), or not verified yet;
- a placement record (:class:`~hookline.shared.contracts.models.Placement`) says so: its breaker is not closed,
  it is slow, backlogged, or being replayed to. Written to the change log by whoever decides it, so
  every replica agrees, and taken back by the leading monitor once the reason has gone.

The queue exists before anything is handed to it: whoever isolates an endpoint declares it first. Past
the bound on queues of their own, a placement isolates an endpoint *held*: in a shared holding lane
(:func:`~hookline.shared.broker.topology.holding_of`) instead of a queue of its own. Its own definition
isolating it (a limit, a pause), it has a queue of its own whatever its placement says.

An isolated endpoint's queue of its own may also be bound to ``events`` for the endpoint's patterns,
its lane no longer bound for them (:func:`direct_patterns`; the leading monitor switches it): its events
then reach it without passing through its lane. An endpoint created ordered is bound so from the start
(``StoredEndpoint.straight``), never laned; one made ordered leaves its lane once a fence has passed it
(:mod:`hookline.dispatcher.fences`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from hookline.shared.broker import topology
from hookline.shared.contracts.models import EndpointStatus, Placement, StoredEndpoint


class Reason(enum.StrEnum):
    LIMITS = "limits"
    PAUSED = "paused"
    DISABLED = "disabled"
    UNVERIFIED = "unverified"
    BREAKER_OPEN = "breaker_open"
    SLOW = "slow"
    BACKLOGGED = "backlogged"
    REPLAY = "replay"


def structural(endpoint: StoredEndpoint) -> Reason | None:
    """What in the endpoint's own definition isolates it (None: nothing)."""
    if endpoint.single_consumer:
        return Reason.LIMITS
    if endpoint.status is EndpointStatus.PAUSED:
        return Reason.PAUSED
    if endpoint.status is EndpointStatus.DISABLED:
        return Reason.DISABLED
    if not endpoint.verified:
        return Reason.UNVERIFIED
    return None


def reason(endpoint: StoredEndpoint, placement: Placement | None) -> str | None:
    """Why the endpoint is isolated; None when it is delivered from its lane."""
    own = structural(endpoint)
    if own is not None:
        return own.value
    if placement is not None and placement.isolated:
        return placement.reason or "isolated"
    return None


def isolated(endpoint: StoredEndpoint, placement: Placement | None) -> bool:
    return reason(endpoint, placement) is not None


def held(endpoint: StoredEndpoint, placement: Placement | None) -> bool:
    """Whether the endpoint is isolated in a holding lane rather than a queue of its own."""
    return placement is not None and placement.isolated and placement.held and structural(endpoint) is None


def direct_patterns(endpoint: StoredEndpoint, *, others: Iterable[StoredEndpoint]) -> tuple[str, ...]:
    """The patterns an endpoint with a queue of its own may have it bound to ``events`` for, so that its
    events stop passing through its lane (a burst to it then costs the broker one queue write per event
    instead of three, and its lane's neighbours nothing): all of its own, unless it is ``ordered`` (for
    a moment during a switch its events come both ways, and a later one could overtake an earlier), or
    one of ``others`` (its tenant's other endpoints, those being deleted among them) names a pattern
    overlapping one of its (the lane stays bound for that one, and would hand this endpoint's copies
    on besides); then none."""
    if endpoint.ordered or not endpoint.laned:
        return ()
    for other in others:
        if other.id != endpoint.id and any(
            topology.patterns_overlap(mine, theirs)
            for mine in endpoint.event_types
            for theirs in other.event_types
        ):
            return ()
    return tuple(sorted(endpoint.event_types))
