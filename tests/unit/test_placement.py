"""Where an endpoint is delivered from: its lane, or a queue of its own (one rule, pure)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from support.factories import stored_endpoint

from hookline.shared.broker import placement
from hookline.shared.contracts.models import DirectRoute, EndpointStatus, Placement

NOW = datetime(2026, 12, 2, tzinfo=UTC)


def _placed(isolated: bool, reason: str = "slow", **fields: Any) -> Placement:
    return Placement(
        endpoint_id="ep_" + "1" * 26, generation=1, isolated=isolated, reason=reason, at=NOW, **fields
    )


@pytest.mark.parametrize(
    ("fields", "placed", "reason"),
    [
        ({}, None, None),  # plain, healthy: from its lane
        ({"rate_limit_per_s": 5.0}, None, "limits"),  # one consumer keeps the rate across replicas
        ({"max_in_flight": 3}, None, "limits"),
        ({"ordered": True}, None, "limits"),
        ({"status": EndpointStatus.PAUSED}, None, "paused"),  # its events wait, unconsumed
        ({"status": EndpointStatus.DISABLED}, None, "disabled"),
        ({"verified": False}, None, "unverified"),
        ({}, _placed(True, "breaker_open"), "breaker_open"),  # decided at run time, by a record
        ({}, _placed(True, "slow"), "slow"),
        ({}, _placed(True, ""), "isolated"),
        ({}, _placed(False, "slow"), None),  # taken back to its lane
        ({}, _placed(False, "", queue_removed=True), None),
        # Its own definition wins over a record that takes it back to its lane.
        ({"ordered": True}, _placed(False, "slow"), "limits"),
        ({"status": EndpointStatus.PAUSED}, _placed(True, "slow"), "paused"),
    ],
)
def test_where_an_endpoint_is_delivered_from(
    fields: dict[str, Any], placed: Placement | None, reason: str | None
) -> None:
    endpoint = stored_endpoint(**fields)
    assert placement.reason(endpoint, placed) == reason
    assert placement.isolated(endpoint, placed) is (reason is not None)


@pytest.mark.parametrize(
    ("fields", "placed", "held"),
    [
        ({}, None, False),
        ({}, _placed(True, "slow"), False),  # a queue of its own
        ({}, _placed(True, "breaker_open", held=True), True),  # past the bound: a holding lane
        ({}, _placed(False, "breaker_open", held=True), False),  # back in its lane
        # Its own definition needs a queue of its own (one consumer, or events waiting unconsumed).
        ({"rate_limit_per_s": 5.0}, _placed(True, "slow", held=True), False),
        ({"status": EndpointStatus.PAUSED}, _placed(True, "slow", held=True), False),
    ],
)
def test_held_past_the_bound_only_for_reasons_of_run_time(
    fields: dict[str, Any], placed: Placement | None, held: bool
) -> None:
    endpoint = stored_endpoint(**fields)
    assert placement.held(endpoint, placed) is held
    if held:
        assert placement.isolated(endpoint, placed)


def test_a_placement_is_written_without_held_unless_it_is() -> None:
    """A version before holding lanes refuses fields it does not know: every placement it can act on
    must read as before."""
    plain = _placed(True, "slow")
    assert "held" not in plain.model_dump_json()
    assert "bound" not in plain.model_dump_json()
    assert Placement.model_validate_json(plain.model_dump_json()) == plain
    held = _placed(True, "slow", held=True)
    assert '"held":true' in held.model_dump_json()
    assert Placement.model_validate_json(held.model_dump_json()) == held


def test_a_placement_is_written_without_direct_unless_it_has_one() -> None:
    plain = _placed(True, "backlogged")
    assert "direct" not in plain.model_dump_json()
    routed = _placed(True, "backlogged", direct=DirectRoute(queue="hookline.endpoint.x", patterns=("a.*",)))
    assert '"direct":{' in routed.model_dump_json()
    assert Placement.model_validate_json(routed.model_dump_json()) == routed


ME = "ep_" + "1" * 26


@pytest.mark.parametrize(
    ("mine", "theirs", "direct"),
    [
        ({"event_types": ["order.*"]}, [], ("order.*",)),  # alone in its tenant
        ({"event_types": ["order.*", "invoice.paid"]}, [["refund.*"]], ("invoice.paid", "order.*")),
        ({"event_types": ["order.*"]}, [["order.created"]], ()),  # another takes order.created from the lane
        ({"event_types": ["order.*"]}, [["#"]], ()),
        ({"event_types": ["order.*"]}, [["order.*"]], ()),
        ({"event_types": ["order.*"], "ordered": True}, [], ()),  # two ways in could reorder a subject
        ({"event_types": ["order.*"], "laned": False}, [], ()),  # not on a lane yet (before lanes)
        ({"event_types": ["order.*"], "rate_limit_per_s": 5.0}, [], ("order.*",)),
    ],
)
def test_routed_directly_unless_ordered_or_overlapping(
    mine: dict[str, Any], theirs: list[list[str]], direct: tuple[str, ...]
) -> None:
    endpoint = stored_endpoint(ME, **mine)
    others = [endpoint] + [
        stored_endpoint("ep_" + str(n + 2) * 26, event_types=t) for n, t in enumerate(theirs)
    ]
    assert placement.direct_patterns(endpoint, others=others) == direct
