"""Names and queue arguments: derived in one place, and safe on RabbitMQ 3.10 through 4.x."""

from __future__ import annotations

import pytest

from hookline.shared import topology


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
