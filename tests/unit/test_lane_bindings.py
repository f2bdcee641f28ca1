"""Which tenant patterns a lane stays bound for, and which the leading monitor may unbind once unneeded."""

from __future__ import annotations

from datetime import UTC, datetime

from support.factories import stored_endpoint

from hookline.health_monitor.bindings import Bindings
from hookline.ingest.bound import BoundPatterns
from hookline.shared.broker import topology
from hookline.shared.contracts.models import (
    DirectRoute,
    EndpointDeleted,
    EndpointDrained,
    EndpointUpserted,
    Placement,
    PlacementSet,
    StoredEndpoint,
)
from hookline.shared.state.registry import EndpointRegistry

NOW = datetime(2026, 12, 2, tzinfo=UTC)
EP1, EP2 = ("ep_" + str(n) * 26 for n in (1, 2))


class _Log:
    """What the tracker reads of a change log here: its registry."""

    def __init__(self) -> None:
        self.registry = EndpointRegistry()


def _upsert(registry: EndpointRegistry, endpoint: StoredEndpoint) -> None:
    registry.apply(EndpointUpserted(change_id="c", at=NOW, endpoint=endpoint))


def test_a_pattern_is_needed_while_an_endpoint_of_the_tenant_names_it_or_is_being_deleted() -> None:
    registry = EndpointRegistry()
    _upsert(registry, stored_endpoint(EP1, event_types=["order.*", "invoice.#"]))
    _upsert(registry, stored_endpoint(EP2, event_types=["order.*"]))
    _upsert(registry, stored_endpoint("ep_" + "3" * 26, tenant="other", event_types=["user.*"]))
    _upsert(registry, stored_endpoint("ep_" + "4" * 26, event_types=["legacy.*"], laned=False))
    assert registry.subscriptions.patterns_needed("acme") == {
        "order.*",
        "invoice.#",
    }  # a legacy endpoint has its own bindings
    registry.apply(EndpointDeleted(change_id="d", at=NOW, endpoint_id=EP1))
    assert registry.subscriptions.patterns_needed("acme") == {
        "order.*",
        "invoice.#",
    }  # its lane has not passed the fence
    registry.apply_drained(EndpointDrained(change_id="f", at=NOW, endpoint_id=EP1))
    assert registry.subscriptions.patterns_needed("acme") == {"order.*"}
    assert registry.subscriptions.patterns_needed("other") == {"user.*"}


def test_patterns_an_endpoint_stops_naming_are_noted_and_named_again_forgotten() -> None:
    change_log = _Log()
    registry = change_log.registry
    tracker = Bindings(broker=None, change_log=change_log, grace_s=60, timeout_s=1)  # type: ignore[arg-type]
    registry.subscribe(tracker.on_change)
    _upsert(registry, stored_endpoint(EP1, event_types=["order.*"]))
    _upsert(registry, stored_endpoint(EP2, event_types=["order.*", "invoice.*"]))
    assert tracker.unneeded == set()
    _upsert(registry, stored_endpoint(EP2, event_types=["order.*"]))  # drops invoice.*: nobody names it
    assert tracker.unneeded == {("acme", "invoice.*")}
    _upsert(registry, stored_endpoint(EP1, event_types=["user.*"]))  # order.* is still named by EP2
    assert tracker.unneeded == {("acme", "invoice.*")}
    _upsert(registry, stored_endpoint(EP1, event_types=["invoice.*"]))  # named again; user.* now by nobody
    assert tracker.unneeded == {("acme", "user.*")}
    registry.apply(EndpointDeleted(change_id="d", at=NOW, endpoint_id=EP2))
    assert tracker.unneeded == {
        ("acme", "user.*")
    }  # order.* still needed: EP2's lane has not passed the fence
    registry.apply_drained(EndpointDrained(change_id="f", at=NOW, endpoint_id=EP2))  # listeners are told
    assert tracker.unneeded == {("acme", "user.*"), ("acme", "order.*")}


def test_an_ingest_binds_a_pattern_once_while_it_stays_needed() -> None:
    registry = EndpointRegistry()
    bound = BoundPatterns(registry)
    registry.subscribe(bound.on_change)
    _upsert(registry, stored_endpoint(EP1, event_types=["order.*"]))
    assert bound.unbound("acme", ["order.*"]) == ["order.*"]
    bound.bound("acme", ["order.*"])
    _upsert(registry, stored_endpoint(EP2, event_types=["order.*"]))
    assert bound.unbound("acme", ["order.*"]) == []  # the tenant's second endpoint binds nothing
    assert bound.unbound("other", ["order.*"]) == ["order.*"]  # another tenant's is its own
    _upsert(registry, stored_endpoint(EP2, event_types=["invoice.*"]))
    assert bound.unbound("acme", ["order.*"]) == []  # still named by EP1
    registry.apply(EndpointDeleted(change_id="d", at=NOW, endpoint_id=EP1))
    registry.apply_drained(EndpointDrained(change_id="f", at=NOW, endpoint_id=EP1))
    # Needed by nobody for a moment: the monitor may unbind it, so the next endpoint naming it binds it.
    assert bound.unbound("acme", ["order.*"]) == ["order.*"]


def _route(
    registry: EndpointRegistry, endpoint: StoredEndpoint, base: int, direct: DirectRoute | None
) -> None:
    placed = Placement(
        endpoint_id=endpoint.id,
        generation=base + 1,
        isolated=True,
        reason="backlogged",
        at=NOW,
        direct=direct,
    )
    registry.apply_placement(PlacementSet(change_id="p", at=NOW, placement=placed, base_generation=base))


def test_a_pattern_routed_directly_to_an_endpoints_queue_is_not_needed_on_its_lane() -> None:
    """Its queue of its own bound to ``events`` for it (a direct route), the lane need not be, and the
    ingest and the monitor's tracker hear of it; the route switched off, the lane needs it again."""
    change_log = _Log()
    registry = change_log.registry
    tracker = Bindings(broker=None, change_log=change_log, grace_s=60, timeout_s=1)  # type: ignore[arg-type]
    bound = BoundPatterns(registry)
    registry.subscribe(tracker.on_change)
    registry.subscribe(bound.on_change)
    _upsert(registry, burst := stored_endpoint(EP1, event_types=["burst.*", "other.*"]))
    _upsert(registry, stored_endpoint(EP2, event_types=["other.*"]))
    bound.bound("acme", ["burst.*", "other.*"])
    route = DirectRoute(queue=topology.own_queue(burst), patterns=("burst.*",))
    _route(registry, burst, 0, route)
    assert registry.placements.direct(burst) == route
    assert registry.subscriptions.lane_patterns(burst) == ["other.*"]
    assert registry.subscriptions.patterns_needed("acme") == {"other.*"}
    assert tracker.unneeded == {("acme", "burst.*")}
    assert bound.unbound("acme", ["burst.*"]) == ["burst.*"]  # an endpoint naming it again binds it
    _route(registry, burst, 1, None)
    assert registry.subscriptions.patterns_needed("acme") == {"burst.*", "other.*"}
    assert tracker.unneeded == set()


def test_a_route_to_a_queue_the_endpoint_has_left_leaves_its_lane_needed() -> None:
    """A change of its options moved it to a queue of the next generation: the route recorded is to the
    one it left, so its lane is needed for the patterns again (the monitor binds it, then unbinds the
    old queue)."""
    registry = EndpointRegistry()
    _upsert(registry, burst := stored_endpoint(EP1, event_types=["burst.*"]))
    _route(registry, burst, 0, DirectRoute(queue=topology.own_queue(burst), patterns=("burst.*",)))
    assert registry.subscriptions.patterns_needed("acme") == set()
    _upsert(registry, burst.model_copy(update={"queue_generation": 1}))
    assert registry.subscriptions.patterns_needed("acme") == {"burst.*"}
