"""Records held while the broker refuses publishes: bounded, the oldest dropped first and counted."""

from __future__ import annotations

import aio_pika
import prometheus_client

from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.broker.heldpublishes import HeldPublishes


def _dropped() -> float:
    return prometheus_client.REGISTRY.get_sample_value("hookline_held_publishes_dropped_total") or 0.0


def test_past_the_bound_the_oldest_record_is_dropped_and_counted() -> None:
    # Not connected: holding does no I/O.
    held = HeldPublishes(Publisher(Broker("amqp://127.0.0.1:1/", name="t", connect_timeout_s=1)), max_held=2)
    before = _dropped()
    messages = [aio_pika.Message(f"{n}".encode()) for n in range(3)]
    for message in messages:
        held.hold(message, exchange="", routing_key="q", what="attempt")
    assert len(held) == 2
    assert _dropped() - before == 1
    assert prometheus_client.REGISTRY.get_sample_value("hookline_held_publishes") == 2
    assert [h.message.body for h in held._held] == [b"1", b"2"]
