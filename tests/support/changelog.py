"""A service's view of the change log on a real broker, for integration tests: its own connection,
publisher and supervised follower, caught up before the block starts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.runtime.supervision import Supervisor
from hookline.shared.state import registry


@asynccontextmanager
async def following(
    amqp_url: str,
    state: registry.EndpointRegistry | None = None,
    *,
    name: str = "test",
    whole_topology: bool = True,
) -> AsyncIterator[tuple[Broker, registry.ChangeLog]]:
    """``whole_topology=False`` declares the change log's stream only: enough for a test of the log
    itself, where the rest (50 quorum queues: 0.85 s of the broker's CPU to declare, 0.5 s to delete)
    took most of its time."""
    supervisor = Supervisor()
    async with Broker(amqp_url, name=name, connect_timeout_s=10) as broker:
        if whole_topology:
            await topology.declare(broker, topology.Retention(event_log_max_age_s=3600))
        else:
            async with broker.channel() as channel:
                await topology.endpoint_log(channel)
        publisher = Publisher(broker)
        try:
            change_log = await registry.follow(
                broker,
                publisher,
                supervisor,
                registry.EndpointRegistry() if state is None else state,
                sync_timeout_s=10,
            )
            yield broker, change_log
        finally:
            await supervisor.stop()
            await publisher.close()
