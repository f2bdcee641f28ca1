"""Where each endpoint is delivered from, as the change log's placement records say: its lane, a queue
of its own, or a holding lane (:mod:`hookline.shared.broker.placement` is the rule), and which
endpoints have a queue of their own now or queues left to drain. Small, so kept in memory and saved
with the registry's rows."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hookline.shared.broker import placement, topology
from hookline.shared.contracts.models import DirectRoute, Placement, StoredEndpoint
from hookline.shared.state.registrystore import RegistryStore


class PlacementBook:
    def __init__(self, store: RegistryStore, get: Callable[[str], StoredEndpoint | None]) -> None:
        """``store``: where placements are kept with the rows; ``get``: a live endpoint by id (None:
        deleted or unknown)."""
        self._store = store
        self._get = get
        self._placements: dict[str, Placement] = {}
        # Endpoints whose queue of their own exists (or may): from the first record that isolates one to
        # the placement that says it was removed. The same for every replica, being the same records in
        # the same order; with those that have queues left to drain, the only endpoints a dispatcher
        # consumes a queue of, or the monitor reads the depth of.
        self._has_queue: set[str] = set()
        self._queued: set[str] = set()
        self.changed = False  # the sets changed since they were last saved

    def load(self, *, has_queue: Iterable[str], queued: Iterable[str]) -> None:
        for body in self._store.kept("placement"):
            placed = Placement.model_validate_json(body)
            self._placements[placed.endpoint_id] = placed
        self._has_queue, self._queued = set(has_queue), set(queued)

    def sets(self) -> dict[str, list[str]]:
        return {"has_queue": sorted(self._has_queue), "queued": sorted(self._queued)}

    def placement(self, endpoint_id: str) -> Placement | None:
        return self._placements.get(endpoint_id)

    def isolated(self, endpoint: StoredEndpoint) -> bool:
        """Whether the endpoint is delivered from a queue of its own (:mod:`hookline.shared.broker.placement`)."""
        return placement.isolated(endpoint, self._placements.get(endpoint.id))

    def held(self, endpoint: StoredEndpoint) -> bool:
        """Whether the endpoint is isolated in a holding lane (past the bound on queues of their own)."""
        return placement.held(endpoint, self._placements.get(endpoint.id))

    def held_endpoints(self) -> list[StoredEndpoint]:
        """Live endpoints isolated in a holding lane."""
        return [
            endpoint
            for endpoint_id, where in sorted(self._placements.items())
            if where.held and (endpoint := self._get(endpoint_id)) is not None and self.held(endpoint)
        ]

    def address(self, endpoint: StoredEndpoint) -> str:
        """Where a message for this endpoint alone goes now: its queue of its own (or its holding lane),
        or its lane."""
        return topology.address(endpoint, isolated=self.isolated(endpoint), held=self.held(endpoint))

    @property
    def queued_count(self) -> int:
        return len(self._queued)

    def has_queue(self, endpoint_id: str) -> bool:
        """Whether the endpoint's queue of its own (its current generation) exists, or may."""
        return endpoint_id in self._has_queue

    def with_queues(self) -> list[StoredEndpoint]:
        """Live endpoints with a queue of their own, or queues left to drain."""
        return [e for endpoint_id in sorted(self._queued) if (e := self._get(endpoint_id)) is not None]

    def direct(self, endpoint: StoredEndpoint) -> DirectRoute | None:
        """The endpoint's queue of its own bound to ``events`` directly, as its placement records it."""
        where = self._placements.get(endpoint.id)
        return where.direct if where is not None else None

    def directly_routed(self) -> list[tuple[str, DirectRoute]]:
        """Every placement that records a direct route: (endpoint id, the route), the endpoint live or not."""
        return [
            (endpoint_id, where.direct)
            for endpoint_id, where in sorted(self._placements.items())
            if where.direct
        ]

    def place(self, placed: Placement) -> Placement:
        """Record a placement that won (its generation was the current one): as written, or held when
        isolations written by other processes came first and reached the bound, as every replica folding
        the log in the same order decides. The placement as it now is; the caller then calls
        :meth:`note`."""
        endpoint_id = placed.endpoint_id
        if (
            placed.bound is not None
            and placed.isolated
            and not placed.held
            and endpoint_id not in self._queued
            and len(self._queued) >= placed.bound
        ):
            placed = placed.model_copy(update={"held": True})
        self._placements[endpoint_id] = placed
        self._store.keep("placement", endpoint_id, placed.model_dump_json().encode())
        if placed.queue_removed:
            self._has_queue.discard(endpoint_id)
        return placed

    def note(self, endpoint: StoredEndpoint, *, new_generation: bool = False, deleted: bool = False) -> bool:
        """The endpoint or its placement changed: whether it has a queue of its own, or queues to drain.
        ``new_generation``: its queue is of the next generation, so the one it had is among those it left
        (drained); the new one exists only if it is isolated. ``deleted``: it is gone, and so is its
        placement. Whether it had queues of its own (they may still hold messages to drain)."""
        had_queues = endpoint.id in self._queued
        if deleted:
            if self._placements.pop(endpoint.id, None) is not None:
                self._store.keep("placement", endpoint.id, None)
            self._has_queue.discard(endpoint.id)
            self._queued.discard(endpoint.id)
            self.changed = True
            return had_queues
        if new_generation:
            self._has_queue.discard(endpoint.id)
        if self.isolated(endpoint) and not self.held(endpoint):
            self._has_queue.add(endpoint.id)
        if endpoint.id in self._has_queue or endpoint.retired_queues:
            self._queued.add(endpoint.id)
        else:
            self._queued.discard(endpoint.id)
        self.changed = True
        return had_queues
