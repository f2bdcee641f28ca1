"""Reading chosen records back from a stream (``streams.read_many``, what a polling endpoint's poll does):
each run of nearby offsets by one consumer, runs far apart by one each, and exactly the records asked
for, whatever lies between them."""

from __future__ import annotations

import aio_pika
import pytest

from hookline.shared.broker import streams
from hookline.shared.broker.amqp import Broker

pytestmark = pytest.mark.integration
STREAM = "reads.stream"


async def test_chosen_records_are_read_back_near_and_far_apart(amqp_url: str) -> None:
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(STREAM, durable=True, arguments={"x-queue-type": "stream"})
        for n in range(2_600):
            await channel.default_exchange.publish(aio_pika.Message(f"r{n}".encode()), routing_key=STREAM)
    # Two runs: 3, 4 and 900 close together; 2,500 more than READ_RUN_GAP past them.
    wanted = [3, 900, 4, 2_500]
    async with Broker(amqp_url, name="hookline-test", connect_timeout_s=10) as broker:
        found = await streams.read_many(broker, STREAM, wanted, timeout_s=30)
        single = await streams.read_many(broker, STREAM, [2_599], timeout_s=30)  # the last record
        none = await streams.read_many(broker, STREAM, [], timeout_s=30)
    assert found == {3: b"r3", 4: b"r4", 900: b"r900", 2_500: b"r2500"}
    assert (single, none) == ({2_599: b"r2599"}, {})
