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
    arguments = topology.endpoint_queue_arguments(ordered=ordered)
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
