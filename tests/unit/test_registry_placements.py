"""What the registry knows for the lanes: which of a tenant's endpoints an event fans out to, where each
is delivered from, and which have a queue of their own (the same for every replica: it follows from the
records alone, in their order)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from support.factories import stored_endpoint

from hookline.shared.contracts.models import (
    EndpointDeleted,
    EndpointDrained,
    EndpointStatus,
    EndpointUpserted,
    Placement,
    PlacementSet,
    StoredEndpoint,
)
from hookline.shared.state.changefold import Stale
from hookline.shared.state.registry import EndpointRegistry

NOW = datetime(2026, 12, 2, tzinfo=UTC)
EP1, EP2, EP3 = ("ep_" + str(n) * 26 for n in (1, 2, 3))


def _upsert(registry: EndpointRegistry, endpoint: StoredEndpoint) -> None:
    registry.apply(EndpointUpserted(change_id="c", at=NOW, endpoint=endpoint))


def _place(registry: EndpointRegistry, endpoint_id: str, base: int, **fields: Any) -> Placement | Stale:
    placed = Placement(endpoint_id=endpoint_id, generation=base + 1, at=NOW, **{"reason": "slow", **fields})
    return registry.apply_placement(
        PlacementSet(change_id="p", at=NOW, placement=placed, base_generation=base)
    )


def test_an_event_fans_out_to_the_tenants_endpoints_whose_patterns_match() -> None:
    registry = EndpointRegistry()
    _upsert(registry, stored_endpoint(EP1, event_types=["order.*"]))
    _upsert(registry, stored_endpoint(EP2, event_types=["order.created", "invoice.#"]))
    _upsert(registry, stored_endpoint(EP3, tenant="other", event_types=["#"]))
    ids = lambda tenant, event_type: sorted(e.id for e in registry.subscriptions.matching(tenant, event_type))  # noqa: E731
    assert ids("acme", "order.created") == [EP1, EP2]
    assert ids("acme", "order.paid") == [EP1]
    assert ids("acme", "invoice.sent.late") == [EP2]
    assert ids("acme", "user.created") == []
    assert ids("other", "order.created") == [EP3]  # never another tenant's
    # A change to one of the tenant's endpoints is seen at once (what was remembered is forgotten).
    _upsert(registry, stored_endpoint(EP1, event_types=["user.*"]))
    assert ids("acme", "order.paid") == []
    assert ids("acme", "user.created") == [EP1]
    registry.apply(EndpointDeleted(change_id="d", at=NOW, endpoint_id=EP2))
    registry.apply_drained(EndpointDrained(change_id="f", at=NOW, endpoint_id=EP2))
    assert ids("acme", "order.created") == []


def test_endpoints_of_the_version_before_lanes_are_passed_over_until_moved_onto_them() -> None:
    registry = EndpointRegistry()
    _upsert(registry, stored_endpoint(EP1, laned=False))  # still fed by its route exchange
    assert registry.subscriptions.matching("acme", "a.b") == ()
    _upsert(registry, stored_endpoint(EP1, laned=True))
    assert [e.id for e in registry.subscriptions.matching("acme", "a.b")] == [EP1]


def test_an_ordered_endpoint_is_subscribed_but_never_fanned_out_to() -> None:
    """Its queue of its own is bound to ``events`` (straight): a lane copy handed on would come twice,
    and could overtake an earlier event of its subject. The event's story still names it."""
    registry = EndpointRegistry()
    _upsert(registry, stored_endpoint(EP1, event_types=["a.*"], ordered=True, laned=False, straight=True))
    _upsert(registry, stored_endpoint(EP2, event_types=["#"]))
    assert [e.id for e in registry.subscriptions.matching("acme", "a.b")] == [EP2]
    assert sorted(e.id for e in registry.subscriptions.subscribed("acme", "a.b")) == [EP1, EP2]
    assert registry.subscriptions.patterns_needed("acme") == {"#"}
    _upsert(registry, stored_endpoint(EP1, event_types=["a.*"]))  # no longer ordered: back on its lane
    assert sorted(e.id for e in registry.subscriptions.matching("acme", "a.b")) == [EP1, EP2]
    assert registry.subscriptions.patterns_needed("acme") == {"#", "a.*"}


def test_an_endpoint_leaving_its_lane_is_fanned_out_to_until_it_has_left_then_for_a_moment() -> None:
    """Made ordered while laned: bound straight and fanned out to still (its lane copies duplicates)
    until its lane has passed the fence; then passed over, but for the lane messages read a moment
    after it left (``left_lane``: the fan-out counts them for a while, so none is lost)."""
    registry = EndpointRegistry()
    leaving = {"event_types": ["a.*"], "ordered": True, "straight": True, "lane_fence": "fence_1"}
    _upsert(registry, stored_endpoint(EP1, **leaving))
    _upsert(registry, stored_endpoint(EP2, event_types=["#"]))
    assert sorted(e.id for e in registry.subscriptions.matching("acme", "a.b")) == [EP1, EP2]
    assert registry.subscriptions.patterns_needed("acme") == {"#", "a.*"}
    assert registry.subscriptions.left_lane("acme", "a.b", within=timedelta(days=1)) == ()
    left_at = datetime.now(UTC) - timedelta(seconds=30)
    _upsert(registry, stored_endpoint(EP1, **leaving, laned=False, left_lane_at=left_at))
    assert [e.id for e in registry.subscriptions.matching("acme", "a.b")] == [EP2]
    assert registry.subscriptions.patterns_needed("acme") == {"#"}
    assert [e.id for e in registry.subscriptions.left_lane("acme", "a.b", within=timedelta(minutes=1))] == [
        EP1
    ]
    assert registry.subscriptions.left_lane("acme", "a.b", within=timedelta(seconds=10)) == ()
    assert (
        registry.subscriptions.left_lane("acme", "c.d", within=timedelta(minutes=1)) == ()
    )  # not one of its patterns


def test_the_endpoints_the_ingest_settles_at_start_are_those_not_on_their_lane_for_good() -> None:
    registry = EndpointRegistry()
    _upsert(registry, stored_endpoint(EP1))  # on its lane
    _upsert(registry, stored_endpoint(EP2, ordered=True))  # ordered on its lane: to leave it
    _upsert(registry, stored_endpoint(EP3, laned=False))  # of the version before lanes
    assert [e.id for e in registry.to_settle()] == [EP2, EP3]


def test_a_placement_applies_on_the_generation_it_was_based_on() -> None:
    registry = EndpointRegistry()
    assert isinstance(_place(registry, EP1, 0, isolated=True), Stale)  # no such endpoint (yet)
    _upsert(registry, endpoint := stored_endpoint(EP1))
    assert not registry.placements.isolated(endpoint)
    assert _place(registry, EP1, 0, isolated=True) == registry.placements.placement(EP1)
    assert registry.placements.isolated(endpoint)
    assert registry.placements.address(endpoint) == f"hookline.endpoint.{EP1}"
    assert isinstance(_place(registry, EP1, 0, isolated=False), Stale)  # another writer came first
    assert registry.placements.isolated(endpoint)
    # The endpoint's own version is untouched: a placement never makes an edit of it stale.
    assert registry.get(EP1) == endpoint.model_copy(update={"version": 1})


def test_a_queue_of_its_own_is_known_from_its_first_isolation_until_its_removal() -> None:
    registry = EndpointRegistry()
    _upsert(registry, endpoint := stored_endpoint(EP1))
    assert not registry.placements.has_queue(EP1)
    assert registry.placements.with_queues() == []
    _upsert(registry, endpoint.model_copy(update={"status": EndpointStatus.PAUSED}))  # its events wait there
    assert registry.placements.has_queue(EP1)
    assert registry.placements.queued_count == 1
    _upsert(registry, endpoint)  # resumed: back in its lane, but the queue still holds what waited
    assert not registry.placements.isolated(endpoint)
    assert registry.placements.address(endpoint).startswith("hookline.lane.")
    assert registry.placements.has_queue(EP1)
    assert [e.id for e in registry.placements.with_queues()] == [EP1]
    _place(registry, EP1, 0, isolated=False, reason="", queue_removed=True)  # the monitor removed it
    assert not registry.placements.has_queue(EP1)
    assert registry.placements.queued_count == 0


def test_a_deleted_endpoint_with_a_queue_is_remembered_for_draining_and_one_without_is_not() -> None:
    registry = EndpointRegistry()
    _upsert(registry, stored_endpoint(EP1, ordered=True))
    _upsert(registry, stored_endpoint(EP2))
    for endpoint_id in (EP1, EP2):
        registry.apply(EndpointDeleted(change_id="d", at=NOW, endpoint_id=endpoint_id))
    assert [e.id for e in registry.deletions.deleted_with_queues_since(NOW)] == [EP1]
    assert sorted(e.id for e in registry.deletions.deleted_since(NOW)) == [EP1, EP2]
    assert registry.placements.queued_count == 0


def test_a_deleted_endpoint_is_counted_by_the_fan_out_until_its_lane_passes_the_fence() -> None:
    """Lane messages published before a deletion still count the endpoint (its copy becomes a dead
    letter, never lost); once a dispatcher took the deletion's fence, nothing counts it."""
    registry = EndpointRegistry()
    _upsert(registry, stored_endpoint(EP1, event_types=["order.*"]))
    registry.apply(EndpointDeleted(change_id="d", at=NOW, endpoint_id=EP1))
    assert registry.get(EP1) is None
    assert registry.deletions.deleting(EP1)
    assert [e.id for e in registry.subscriptions.matching("acme", "order.paid")] == [EP1]
    registry.apply_drained(EndpointDrained(change_id="f", at=NOW, endpoint_id=EP1))
    assert not registry.deletions.deleting(EP1)
    assert registry.subscriptions.matching("acme", "order.paid") == ()
    registry.apply_drained(EndpointDrained(change_id="f", at=NOW, endpoint_id=EP1))  # again: no-op
    # Created again under the same id (a notifier's is derived): live, and not deleting any more.
    _upsert(registry, stored_endpoint(EP2, event_types=["order.*"]))
    registry.apply(EndpointDeleted(change_id="d2", at=NOW, endpoint_id=EP2))
    _upsert(registry, stored_endpoint(EP2, event_types=["order.*"]))
    assert not registry.deletions.deleting(EP2)
    assert [e.id for e in registry.subscriptions.matching("acme", "order.paid")] == [EP2]


def test_a_lane_message_given_out_again_counts_the_endpoints_deleted_since() -> None:
    """Its dispatcher died before acking it, and the fence of an endpoint deleted meanwhile has passed:
    the endpoint is named for it (its copy kept as a dead letter), by tenant, pattern and time."""
    registry = EndpointRegistry()
    _upsert(registry, stored_endpoint(EP1, event_types=["order.*"]))
    _upsert(registry, stored_endpoint(EP2, event_types=["user.*"]))
    _upsert(registry, stored_endpoint(EP3, tenant="other", event_types=["order.*"]))
    for endpoint_id in (EP1, EP2, EP3):
        registry.apply(EndpointDeleted(change_id="d", at=NOW, endpoint_id=endpoint_id))
        registry.apply_drained(EndpointDrained(change_id="f", at=NOW, endpoint_id=endpoint_id))
    assert registry.subscriptions.matching("acme", "order.paid") == ()
    assert [e.id for e in registry.deletions.deleted_matching("acme", "order.paid", since=NOW)] == [EP1]
    assert registry.deletions.deleted_matching("acme", "order.paid", since=NOW + timedelta(seconds=1)) == []


def test_a_placement_past_its_writers_bound_as_the_log_has_it_holds_the_endpoint_instead() -> None:
    """Writers in several processes each under the bound by their own count: the fold decides, the same
    on every replica, and a held endpoint counts no queue of its own."""
    registry = EndpointRegistry()
    for endpoint_id in (EP1, EP2, EP3):
        _upsert(registry, stored_endpoint(endpoint_id))
    first = _place(registry, EP1, 0, isolated=True, bound=2)
    second = _place(registry, EP2, 0, isolated=True, bound=2)
    third = _place(registry, EP3, 0, isolated=True, bound=2)
    assert isinstance(first, Placement)
    assert isinstance(second, Placement)
    assert isinstance(third, Placement)
    assert (first.held, second.held, third.held) == (False, False, True)
    assert registry.placements.queued_count == 2
    assert [registry.placements.has_queue(e) for e in (EP1, EP2, EP3)] == [True, True, False]
    ep3 = registry.get(EP3)
    assert ep3 is not None
    assert registry.placements.held(ep3)
    assert registry.placements.address(ep3).startswith("hookline.holding.")
    # One already counted (its queue not yet removed) is placed again within the bound it holds.
    _place(registry, EP1, 1, isolated=False)
    again = _place(registry, EP1, 2, isolated=True, bound=2)
    assert isinstance(again, Placement)
    assert not again.held
    # Without a bound (written by a version before it), as before.
    back = _place(registry, EP3, 1, isolated=False)
    unbounded = _place(registry, EP3, 2, isolated=True)
    assert isinstance(back, Placement)
    assert isinstance(unbounded, Placement)
    assert not unbounded.held
