"""Which endpoints an event goes to: a tenant's endpoints whose patterns match its type (those deleted
whose lane has not passed the fence among them), remembered per tenant and type until one of the
tenant's endpoints changes; and the patterns each tenant's lane must stay bound for."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hookline.shared.broker import topology
from hookline.shared.contracts.models import StoredEndpoint
from hookline.shared.state.deletions import Deletions
from hookline.shared.state.endpointrows import EndpointRows
from hookline.shared.state.placementbook import PlacementBook

#: (tenant, type) pairs whose matching endpoints are remembered; past it the memo starts over.
_MATCHES_KEPT = 100_000
#: Per tenant and event type: the endpoints subscribed, the laned ones among them (the fan-out's), and
#: those that have left their lane (:meth:`Subscriptions.left_lane`).
_Matches = tuple[tuple[StoredEndpoint, ...], tuple[StoredEndpoint, ...], tuple[StoredEndpoint, ...]]


class Subscriptions:
    def __init__(self, rows: EndpointRows, deletions: Deletions, placements: PlacementBook) -> None:
        self._rows = rows
        self._deletions = deletions
        self._placements = placements
        self._matches: dict[str, dict[str, _Matches]] = {}  # tenant -> type -> (subscribed, laned, left)
        self._matches_kept = 0

    def matching(self, tenant: str, event_type: str) -> tuple[StoredEndpoint, ...]:
        """The tenant's laned endpoints one of whose patterns matches ``event_type``: the fan-out of a lane
        message. An endpoint deleted a moment ago is among them until its lane has passed the deletion's
        fence (its copy is then kept as a dead letter: nothing published before a deletion is lost); an
        endpoint not laned is passed over (its queue of its own is bound to ``events``: ordered, or of
        the version before lanes until the ingest moves it onto its lane), and so is a polling one."""
        return self._subscribed(tenant, event_type)[1]

    def subscribed(self, tenant: str, event_type: str) -> tuple[StoredEndpoint, ...]:
        """The tenant's endpoints one of whose patterns matches ``event_type``, laned or not, polling ones
        too (those deleted whose lane has not passed the fence among them): the delivery log's."""
        return self._subscribed(tenant, event_type)[0]

    def left_lane(self, tenant: str, event_type: str, *, within: timedelta) -> tuple[StoredEndpoint, ...]:
        """The tenant's endpoints one of whose patterns matches ``event_type`` that left their lane at most
        ``within`` ago (made ordered: ``StoredEndpoint.left_lane_at``)."""
        left = self._subscribed(tenant, event_type)[2]
        if not left:
            return ()  # nearly always: no clock read
        since = datetime.now(UTC) - within
        return tuple(e for e in left if e.left_lane_at is not None and e.left_lane_at >= since)

    def _subscribed(self, tenant: str, event_type: str) -> _Matches:
        """Every endpoint subscribed, and the laned ones among them: remembered per tenant and type until
        one of the tenant's endpoints changes, or the tenant leaves the cache."""
        of_tenant = self._matches.get(tenant)
        found = of_tenant.get(event_type) if of_tenant is not None else None
        if found is None:
            every = tuple(
                endpoint
                for endpoints in (self._rows.tenant_map(tenant), self._deletions.pending(tenant))
                for endpoint in endpoints.values()
                if any(topology.topic_matches(pattern, event_type) for pattern in endpoint.event_types)
            )
            found = (
                every,
                tuple(endpoint for endpoint in every if endpoint.on_lane),
                tuple(endpoint for endpoint in every if not endpoint.laned and endpoint.left_lane_at),
            )
            if self._matches_kept >= _MATCHES_KEPT:
                self._matches.clear()
                self._matches_kept = 0
            self._matches.setdefault(tenant, {})[event_type] = found
            self._matches_kept += 1
        return found

    def forget(self, tenant: str) -> None:
        """One of the tenant's endpoints changed (or they left the cache): its matches are found again."""
        self._matches_kept -= len(self._matches.pop(tenant, {}))

    def patterns_needed(self, tenant: str) -> set[str]:
        """The patterns the tenant's lane must stay bound for: those of its endpoints (but those an
        endpoint's queue of its own is bound to ``events`` for: :meth:`lane_patterns`), and of those
        deleted whose lane has not passed the fence yet (their events still become dead letters)."""
        endpoints = self._rows.tenant_map(tenant).values()
        live = (p for e in endpoints if e.on_lane for p in self.lane_patterns(e))
        deleting = (p for e in self._deletions.pending(tenant).values() if e.on_lane for p in e.event_types)
        return {*live, *deleting}

    def lane_patterns(self, endpoint: StoredEndpoint) -> list[str]:
        """The endpoint's patterns its lane must be bound for: all of them, but those its current queue of
        its own is bound to ``events`` for (:meth:`PlacementBook.direct`)."""
        route = self._placements.direct(endpoint)
        if (
            route is None
            or route.queue != topology.own_queue(endpoint)
            or not self._placements.has_queue(endpoint.id)
        ):
            return endpoint.event_types
        return [pattern for pattern in endpoint.event_types if pattern not in route.patterns]
