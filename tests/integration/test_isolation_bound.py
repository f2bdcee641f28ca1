"""The bound on queues of their own holds when many endpoints need one at once (a receiver host that
slows down for all of its endpoints): isolations under way count against it, so no more queues are
declared than it allows."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from support.amqp import queue_exists

from hookline.shared import registry, topology
from hookline.shared.amqp import Broker, Publisher
from hookline.shared.isolation import Isolation
from hookline.shared.models import SigningSecret, StoredEndpoint
from hookline.shared.signing import generate_secret
from hookline.shared.supervision import Supervisor

pytestmark = pytest.mark.integration
NOW = datetime.now(UTC)
BOUND = 3


def _endpoint(n: int) -> StoredEndpoint:
    return StoredEndpoint(
        id=f"ep_{n:026d}",
        tenant="acme",
        url=f"https://example.com/{n}",
        event_types=["#"],
        created_at=NOW,
        updated_at=NOW,
        secrets=[SigningSecret(value=generate_secret(), created_at=NOW)],
        laned=True,
    )


async def test_many_isolations_at_once_declare_no_more_queues_than_the_bound(amqp_url: str) -> None:
    supervisor = Supervisor()
    async with Broker(amqp_url, name="isolation", connect_timeout_s=10) as broker:
        await topology.declare(broker, topology.Retention(event_log_max_age_s=3600))
        publisher = Publisher(broker)
        try:
            change_log = await registry.follow(
                broker, publisher, supervisor, registry.EndpointRegistry(), sync_timeout_s=10
            )
            endpoints = [_endpoint(n) for n in range(12)]
            await change_log.create_many(endpoints, timeout_s=10)
            isolation = Isolation(broker, change_log, max_queues=BOUND, timeout_s=10)
            isolated = await asyncio.gather(*(isolation.isolate(e, "slow") for e in endpoints))
            assert sum(isolated) == BOUND
            assert change_log.registry.queued_count == BOUND
            declared = [await queue_exists(amqp_url, topology.endpoint_queue(e.id)) for e in endpoints]
            assert declared == isolated, "a queue was declared for an endpoint the bound refused"
        finally:
            await supervisor.stop()
            await publisher.close()
