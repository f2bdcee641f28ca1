"""Names and queue arguments: derived in one place, and safe on RabbitMQ 3.10 through 4.x."""

from __future__ import annotations

import itertools
import shlex
from datetime import UTC, datetime

import pytest

from hookline.shared.broker import topology
from hookline.shared.contracts.models import StoredEndpoint


def test_binding_keys_prefix_every_pattern_with_the_tenant() -> None:
    assert topology.binding_keys("acme", ["order.*", "#", "order.*"]) == {"acme.order.*", "acme.#"}


def test_event_routing_key() -> None:
    assert topology.event_routing_key("acme", "order.created") == "acme.order.created"


@pytest.mark.parametrize("ordered", [False, True])
def test_endpoint_queue_arguments_are_portable(ordered: bool) -> None:
    arguments = topology.endpoint_queue_arguments(single_consumer=ordered)
    assert arguments["x-queue-type"] == "quorum"
    # -1 would mean "dead-letter on the first return" on 3.x: the limit is always explicit and positive.
    assert arguments["x-delivery-limit"] > 0
    assert arguments["x-dead-letter-exchange"] == topology.DEAD_LETTER_EXCHANGE
    # at-least-once dead-lettering silently degrades without reject-publish.
    assert (arguments["x-dead-letter-strategy"], arguments["x-overflow"]) == (
        "at-least-once",
        "reject-publish",
    )
    assert "x-queue-mode" not in arguments
    assert arguments.get("x-single-active-consumer", False) is ordered


def test_endpoint_queue_name_fits_a_routing_key() -> None:
    name = topology.endpoint_queue("ep_" + "0" * 26)
    assert name == "hookline.endpoint.ep_" + "0" * 26
    assert len(name.encode()) < 199


@pytest.mark.parametrize(
    ("pattern", "key", "expected"),
    [
        ("order.created", "order.created", True),
        ("order.created", "order.updated", False),
        ("order.*", "order.created", True),
        ("order.*", "order", False),
        ("order.*", "order.created.v2", False),
        ("order.#", "order", True),
        ("order.#", "order.created.v2", True),
        ("#", "anything.at.all", True),
        ("#.created", "order.created", True),
        ("#.created", "created", True),
        ("#.created", "order.created.v2", False),
        ("*.created", "order.created", True),
        ("a.#.z", "a.z", True),
        ("a.#.z", "a.b.c.z", True),
        ("a.*.z", "a.z", False),
        ("acme.order.*", "acme.order.created", True),
        ("acme.order.*", "other.order.created", False),
    ],
)
def test_topic_matches_like_rabbitmq(pattern: str, key: str, expected: bool) -> None:
    assert topology.topic_matches(pattern, key) is expected


@pytest.mark.parametrize(
    ("first", "second", "overlap"),
    [
        ("order.created", "order.created", True),
        ("order.created", "order.updated", False),
        ("order.*", "order.created", True),
        ("order.*", "invoice.*", False),
        ("order.*", "order.*.*", False),  # two words against three
        ("*.created", "order.*", True),  # order.created
        ("order.#", "order", True),  # # matching no word
        ("order.#", "invoice.#", False),
        ("#", "anything.at.all", True),
        ("#.created", "order.#", True),  # order.created
        ("a.*.c", "a.#", True),
        ("a.#.z", "a.b", False),
        ("#.x", "#.y", False),  # the last word differs
        ("#.#", "a", True),
        ("*", "a.b", False),
    ],
)
def test_patterns_overlap_when_a_routing_key_matches_both(first: str, second: str, overlap: bool) -> None:
    assert topology.patterns_overlap(first, second) is overlap
    assert topology.patterns_overlap(second, first) is overlap


def test_patterns_overlap_agrees_with_matching_every_short_key() -> None:
    """Every pair of patterns of up to three words of a, b, * and #, against every key of up to four words
    of a, b and c (c: a word neither names)."""
    parts = ["a", "b", "*", "#"]
    patterns = [".".join(w) for n in range(1, 4) for w in itertools.product(parts, repeat=n)]
    keys = [".".join(w) for n in range(1, 5) for w in itertools.product("abc", repeat=n)]
    for first, second in itertools.product(patterns, repeat=2):
        matched = any(topology.topic_matches(first, k) and topology.topic_matches(second, k) for k in keys)
        assert topology.patterns_overlap(first, second) is matched, (first, second)


@pytest.mark.parametrize(
    ("delay_s", "entry", "bits"),
    [
        (1, "hookline.delay.00", "0" * 27 + "1"),
        (2, "hookline.delay.01", "0" * 26 + "10"),
        (10, "hookline.delay.03", "0" * 24 + "1010"),
        (21600, "hookline.delay.14", format(21600, "028b")),
        (2**28 - 1, "hookline.delay.27", "1" * 28),
    ],
)
def test_delay_routing(delay_s: int, entry: str, bits: str) -> None:
    key = topology.delay_routing_key(delay_s, "hookline.endpoint.ep_X")
    assert key == ".".join(bits) + ".hookline.endpoint.ep_X"
    assert topology.delay_entry(delay_s) == entry
    # The delivery binding matches exactly this destination, whatever the bits.
    binding = topology.delay_delivery_binding("hookline.endpoint.ep_X")
    assert topology.topic_matches(binding, key)
    assert not topology.topic_matches(binding, topology.delay_routing_key(delay_s, "hookline.endpoint.ep_XY"))
    assert not topology.topic_matches(
        binding, topology.delay_routing_key(delay_s, "x.hookline.endpoint.ep_X")
    )


@pytest.mark.parametrize("delay_s", [-1, 2**28])
def test_delay_out_of_range(delay_s: int) -> None:
    with pytest.raises(ValueError, match="a delay must be"):
        topology.delay_routing_key(delay_s, "q")


# --- names per endpoint: queue generations, route exchanges, retry destinations -----------------

EP = "ep_" + "0" * 26
NOW = datetime(2026, 11, 29, tzinfo=UTC)


def _stored(**fields: object) -> StoredEndpoint:
    return StoredEndpoint.model_validate(
        {
            "id": EP,
            "tenant": "acme",
            "url": "https://example.com/",
            "event_types": ["#"],
            "created_at": NOW,
            "updated_at": NOW,
            "secrets": [{"value": "whsec_" + "A" * 44, "created_at": NOW}],
            **fields,
        }
    )


@pytest.mark.parametrize(
    ("generation", "queue"),
    [
        (0, f"hookline.endpoint.{EP}"),  # generation 0 keeps the name of the version before generations
        (1, f"hookline.endpoint.{EP}.g1"),
        (2, f"hookline.endpoint.{EP}.g2"),
        (17, f"hookline.endpoint.{EP}.g17"),
    ],
)
def test_queue_names_per_generation(generation: int, queue: str) -> None:
    assert topology.endpoint_queue(EP, generation) == queue
    assert topology.endpoint_of(queue) == EP
    assert topology.endpoint_queues(_stored(queue_generation=generation)) == [queue]


def test_route_exchanges() -> None:
    assert topology.route_exchange(EP) == f"hookline.route.{EP}"
    assert topology.route_alternate(EP) == f"hookline.route.{EP}.alt"


@pytest.mark.parametrize(
    ("name", "endpoint_id"),
    [
        (f"hookline.endpoint.{EP}", EP),
        (f"hookline.endpoint.{EP}.g3", EP),
        (f"hookline.route.{EP}", EP),
        (f"hookline.route.{EP}.alt", EP),
        ("hookline.endpoint.", None),
        ("hookline.route.", None),
        ("hookline.endpoints", None),  # the change log is no endpoint's
        ("hookline.delay.03", None),
        ("hookline.delay.delivery", None),
        ("hookline.dead-letters", None),
        ("events", None),
        (f"x.hookline.endpoint.{EP}", None),
        ("", None),
    ],
)
def test_endpoint_of(name: str, endpoint_id: str | None) -> None:
    assert topology.endpoint_of(name) == endpoint_id


@pytest.mark.parametrize(
    ("endpoint", "isolated", "destination"),
    [
        # Without a queue of its own, what is meant for the endpoint alone goes to its tenant's lane.
        (_stored(), False, topology.lane_of("acme")),
        (_stored(queue_generation=3), False, topology.lane_of("acme")),
        # With one, to that queue, of its current generation.
        (_stored(), True, f"hookline.endpoint.{EP}"),
        (_stored(queue_generation=3), True, f"hookline.endpoint.{EP}.g3"),
    ],
)
def test_an_address_and_back_through_the_delays(
    endpoint: StoredEndpoint, isolated: bool, destination: str
) -> None:
    assert topology.address(endpoint, isolated=isolated) == destination
    for delay_s in (0, 1, 300, topology.MAX_DELAY_S):
        key = topology.delay_routing_key(delay_s, destination)
        assert topology.delay_destination(key) == destination
        assert topology.topic_matches(topology.delay_delivery_binding(destination), key)
    # A lane is nobody's; an endpoint queue names its endpoint (an unroutable copy is forwarded to it).
    assert topology.endpoint_of(destination) == (EP if isolated else None)
    assert topology.is_lane(destination) is not isolated


def test_a_held_endpoint_has_a_holding_lane_of_a_fixed_set_apart_from_the_lanes() -> None:
    holding = topology.holding_queues()
    assert len(holding) == len(set(holding)) == topology.HOLDING_LANES
    assert not set(holding) & set(topology.lane_queues())
    assert set(holding) <= set(topology.core_queues())  # declared with the core topology, always there
    endpoint = _stored()
    destination = topology.address(endpoint, isolated=True, held=True)
    assert destination == topology.holding_of(EP)
    assert destination in holding
    assert topology.is_holding(destination)
    assert not topology.is_lane(destination)
    assert topology.endpoint_of(destination) is None  # shared: nobody's queue
    key = topology.delay_routing_key(300, destination)
    assert topology.topic_matches(topology.delay_delivery_binding(destination), key)
    # CRC-32 of the id spreads held endpoints over them.
    spread = {topology.holding_of(f"ep_{n:026d}") for n in range(100)}
    assert spread == set(holding)


def test_a_tenant_has_one_lane_of_a_fixed_set() -> None:
    lanes = topology.lane_queues()
    assert len(lanes) == len(set(lanes)) == topology.LANES
    assert lanes[0] == "hookline.lane.00"
    assert lanes[-1] == f"hookline.lane.{topology.LANES - 1:02d}"
    assert all(topology.lane_of(f"t{n}") in lanes for n in range(1000))
    assert topology.lane_of("acme") == topology.lane_of("acme")  # the same for every service, every run
    # CRC-32 spreads tenants over the lanes: none holds more than twice its share of 1,000 tenants.
    counts = {lane: 0 for lane in lanes}
    for n in range(1000):
        counts[topology.lane_of(f"tenant-{n}")] += 1
    assert max(counts.values()) < 2 * 1000 / topology.LANES


@pytest.mark.parametrize(
    ("key", "destination"),
    [
        ("0." * 27 + "1.hookline.route.ep_X", "hookline.route.ep_X"),
        ("1." * 28 + "hookline.endpoint.ep_X.g2", "hookline.endpoint.ep_X.g2"),
        ("0." * 28 + "q", "q"),
    ],
)
def test_delay_destination_is_everything_after_the_28_bits(key: str, destination: str) -> None:
    assert topology.delay_destination(key) == destination


def test_endpoint_queues_are_the_current_one_and_those_it_left() -> None:
    endpoint = _stored(
        queue_generation=2, retired_queues=[topology.endpoint_queue(EP), topology.endpoint_queue(EP, 1)]
    )
    assert topology.endpoint_queues(endpoint) == [
        f"hookline.endpoint.{EP}.g2",
        f"hookline.endpoint.{EP}",
        f"hookline.endpoint.{EP}.g1",
    ]


def test_core_queues_are_what_every_service_relies_on() -> None:
    core = topology.core_queues()
    assert len(core) == len(set(core)) == 8 + topology.DELAY_BITS + topology.LANES + topology.HOLDING_LANES
    assert set(core) >= {
        "hookline.unrouted",
        "hookline.events.log",
        "hookline.dead-letters",
        "hookline.endpoints",
        "hookline.telemetry.log",
        "hookline.breakers",
        "hookline.audit",
        "hookline.delay.unroutable",
        "hookline.delay.00",
        "hookline.delay.27",
    }
    assert all(topology.endpoint_of(name) is None for name in core), "no endpoint's queue is core"
    assert topology.MONITOR_LEADER_LOCK not in core, "the leader lock comes and goes with its monitor"


def test_every_capped_stream_has_an_age_and_a_byte_cap_and_the_budget_adds_them_up() -> None:
    retention = topology.Retention()
    arguments = retention.arguments()
    assert set(arguments) == {
        topology.EVENT_LOG, topology.DEAD_LETTER_STREAM, topology.TELEMETRY_LOG, topology.BREAKER_LOG,
        topology.AUDIT_LOG,
    }  # fmt: skip
    for stream in arguments.values():
        assert stream["x-queue-type"] == "stream"
        assert stream["x-max-age"]
        assert 0 < stream["x-stream-max-segment-size-bytes"] <= stream["x-max-length-bytes"] // 20
    # The defaults: 20 GB of events, 5 GB of dead letters, 4 GB of telemetry, 0.2 GB of breaker states,
    # 1 GB of audit trail, each with the segment being written on top.
    assert retention.disk_budget_bytes == (
        30_200_000_000 + 500_000_000 + 250_000_000 + 50_000_000 + 5_000_000 + 50_000_000
    )
    # The telemetry stream keeps the arguments it always had: no warning for it on an upgrade.
    assert arguments[topology.TELEMETRY_LOG] == {
        "x-queue-type": "stream",
        "x-max-age": "25h",
        "x-max-length-bytes": 4_000_000_000,
        "x-stream-max-segment-size-bytes": 50_000_000,
    }


@pytest.mark.parametrize(
    ("max_bytes", "segment"), [(10_000_000, 1_000_000), (1_000_000_000, 50_000_000), (10**12, 500_000_000)]
)
def test_segments_are_a_twentieth_of_the_cap_between_1_and_500_mb(max_bytes: int, segment: int) -> None:
    arguments = topology.Retention(event_log_max_bytes=max_bytes).arguments()[topology.EVENT_LOG]
    assert arguments["x-stream-max-segment-size-bytes"] == segment


def test_the_retention_policy_is_a_command_an_operator_can_paste() -> None:
    arguments = topology.Retention().arguments()[topology.DEAD_LETTER_STREAM]
    command = topology.retention_policy(topology.DEAD_LETTER_STREAM, arguments, vhost="my vhost")
    assert shlex.split(command) == [
        "rabbitmqctl", "set_policy", "-p", "my vhost", "--apply-to", "queues",
        "hookline.dead-letters-retention", r"^hookline\.dead\-letters$",
        '{"max-age": "30D", "max-length-bytes": 5000000000, "stream-max-segment-size-bytes": 250000000}',
    ]  # fmt: skip
