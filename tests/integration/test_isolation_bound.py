"""The bound on queues of their own holds when many endpoints need one at once (a receiver host that
slows down for all of its endpoints): isolations under way count against it, so no more queues are
declared than it allows, and the endpoints past it are held in the shared holding lanes."""

from __future__ import annotations

import asyncio

import pytest
from support.amqp import queue_exists
from support.changelog import following
from support.factories import stored_endpoint

from hookline.shared.broker import topology
from hookline.shared.broker.isolation import DECLARING_AT_ONCE, Isolation
from hookline.shared.contracts.models import StoredEndpoint

pytestmark = pytest.mark.integration
BOUND = 3


async def test_many_isolations_at_once_declare_no_more_queues_than_the_bound(amqp_url: str) -> None:
    async with following(amqp_url, name="isolation") as (broker, change_log):
        endpoints = [stored_endpoint(f"ep_{n:026d}", url=f"https://example.com/{n}") for n in range(12)]
        await change_log.create_many(endpoints, timeout_s=10)
        isolation = Isolation(broker, change_log, max_queues=BOUND, timeout_s=10)
        isolated = await asyncio.gather(*(isolation.isolate(e, "slow") for e in endpoints))
        registry = change_log.registry
        # Every one isolated: the bound's worth with a queue of their own, the others held past it.
        assert all(isolated)
        own = [registry.placements.has_queue(e.id) for e in endpoints]
        assert sum(own) == registry.placements.queued_count == BOUND
        assert [registry.placements.held(e) for e in endpoints] == [not has for has in own]
        declared = [await queue_exists(amqp_url, topology.endpoint_queue(e.id)) for e in endpoints]
        assert declared == own, "a queue was declared for an endpoint held past the bound"
        for endpoint, has in zip(endpoints, own, strict=True):
            address = registry.placements.address(endpoint)
            assert address == (
                topology.endpoint_queue(endpoint.id) if has else topology.holding_of(endpoint.id)
            )


async def test_many_isolations_at_once_declare_their_queues_a_few_at_a_time(
    amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver host slowing down for a hundred endpoints at once: their quorum queues are declared
    ``DECLARING_AT_ONCE`` at a time, not all within a moment (which made the healthy endpoints beside
    them wait 160-235 ms for one event), and every one of them still gets its queue."""
    async with following(amqp_url, name="isolation-paced") as (broker, change_log):
        endpoints = [stored_endpoint(f"ep_{n:026d}", url=f"https://example.com/{n}") for n in range(8)]
        await change_log.create_many(endpoints, timeout_s=10)
        isolation = Isolation(broker, change_log, max_queues=100, timeout_s=10)
        declare = isolation.ensure_queue
        declaring: set[str] = set()
        most_at_once = 0

        async def counted(endpoint: StoredEndpoint) -> None:
            nonlocal most_at_once
            declaring.add(endpoint.id)
            most_at_once = max(most_at_once, len(declaring))
            try:
                await declare(endpoint)
            finally:
                declaring.discard(endpoint.id)

        monkeypatch.setattr(isolation, "ensure_queue", counted)
        assert all(await asyncio.gather(*(isolation.isolate(e, "slow") for e in endpoints)))
        assert most_at_once == DECLARING_AT_ONCE
        assert all(change_log.registry.placements.has_queue(e.id) for e in endpoints)


async def test_the_bound_holds_across_processes_and_every_replica_agrees(amqp_url: str) -> None:
    """Two processes isolating the same twelve endpoints at once, each under the bound by its own count:
    the change log decides, so no more than the bound's worth have a queue of their own (the others
    held, on both replicas alike) and no queue is left declared for a held one."""
    async with (
        following(amqp_url, name="isolation-a") as (broker_a, log_a),
        following(amqp_url, name="isolation-b") as (broker_b, log_b),
    ):
        endpoints = [stored_endpoint(f"ep_{n:026d}", url=f"https://example.com/{n}") for n in range(12)]
        await log_a.create_many(endpoints, timeout_s=10)
        await log_b.sync(timeout_s=10)
        a = Isolation(broker_a, log_a, max_queues=BOUND, timeout_s=10)
        b = Isolation(broker_b, log_b, max_queues=BOUND, timeout_s=10)
        isolated = await asyncio.gather(
            *(a.isolate(e, "slow") for e in endpoints), *(b.isolate(e, "slow") for e in reversed(endpoints))
        )
        assert all(isolated)
        await log_a.sync(timeout_s=10)
        await log_b.sync(timeout_s=10)
        # At most the bound; fewer when timing has it so: each process counts its own isolations under
        # way, so it may write "held" for an endpoint the other is giving a queue, and whichever record
        # comes first stands (the leading monitor promotes a held endpoint once the bound has room).
        queued = [registry.placements.queued_count for registry in (log_a.registry, log_b.registry)]
        assert queued[0] == queued[1] <= BOUND, queued
        own_a = [log_a.registry.placements.has_queue(e.id) for e in endpoints]
        assert own_a == [log_b.registry.placements.has_queue(e.id) for e in endpoints], (
            "the replicas disagree"
        )
        assert [log_b.registry.placements.held(e) for e in endpoints] == [not has for has in own_a]
        declared = [await queue_exists(amqp_url, topology.endpoint_queue(e.id)) for e in endpoints]
        assert declared == own_a, "a queue is left declared for an endpoint held past the bound"


async def test_an_isolation_whose_write_fails_leaves_no_queue_behind(
    amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The placement's write timing out (a broker too busy to confirm it in time; here the timeout is
    made to happen) leaves the endpoint in its lane and removes the queue declared for it: a queue the
    bound does not count holds broker file handles nobody accounts for."""
    async with following(amqp_url, name="isolation-fails") as (broker, change_log):
        endpoint = stored_endpoint("ep_" + "9" * 26, url="https://example.com/9")
        await change_log.create_many([endpoint], timeout_s=10)
        isolation = Isolation(broker, change_log, max_queues=BOUND, timeout_s=10)

        async def times_out(*_: object, **__: object) -> None:
            assert await queue_exists(amqp_url, topology.endpoint_queue(endpoint.id))  # declared first
            raise TimeoutError

        monkeypatch.setattr(change_log, "place", times_out)
        assert not await isolation.isolate(endpoint, "slow")
        assert not change_log.registry.placements.has_queue(endpoint.id)
        assert not await queue_exists(amqp_url, topology.endpoint_queue(endpoint.id))


async def test_a_held_endpoint_gets_a_queue_of_its_own_once_the_bound_has_room(amqp_url: str) -> None:
    """Held past the bound, an endpoint shares its holding lane's head of line with the others held; once
    a queue of its own is removed (its endpoint back in its lane, drained), one held endpoint takes the
    room, and the next finds the bound full again."""
    async with following(amqp_url, name="promotion") as (broker, change_log):
        endpoints = [stored_endpoint(f"ep_{n:026d}", url=f"https://example.com/{n}") for n in range(5)]
        await change_log.create_many(endpoints, timeout_s=10)
        isolation = Isolation(broker, change_log, max_queues=BOUND, timeout_s=10)
        for endpoint in endpoints:
            assert await isolation.isolate(endpoint, "slow")
        registry = change_log.registry
        own = [e for e in endpoints if registry.placements.has_queue(e.id)]
        held = [e for e in endpoints if registry.placements.held(e)]
        assert (len(own), len(held)) == (BOUND, 2)
        assert not await isolation.promote(held[0]), "promoted past the bound"
        assert not await isolation.promote(own[0]), "an endpoint with a queue of its own is not held"

        # The first one's queue removed, as the monitor removes a drained one (its endpoint back inline).
        await change_log.place(own[0].id, isolated=False, reason="slow", timeout_s=10)
        await change_log.place(own[0].id, isolated=False, reason="", queue_removed=True, timeout_s=10)
        assert registry.placements.queued_count == BOUND - 1

        assert await isolation.promote(held[0])
        assert registry.placements.has_queue(held[0].id)
        assert not registry.placements.held(held[0])
        assert registry.placements.address(held[0]) == topology.endpoint_queue(held[0].id)
        assert await queue_exists(amqp_url, topology.endpoint_queue(held[0].id))
        placed = registry.placements.placement(held[0].id)
        assert placed is not None
        assert placed.reason == "slow", "promoted for the reason it was held for"
        assert not await isolation.promote(held[1]), "the bound is full again"
        assert registry.placements.held(held[1])
        assert not await queue_exists(amqp_url, topology.endpoint_queue(held[1].id))


async def test_an_isolation_placed_elsewhere_while_its_queue_is_declared_writes_nothing_more(
    amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas find the same endpoint slow: the second's declare of its queue is slow, and the
    first's placement reaches it meanwhile. Its own write would be a second isolation on top of the
    first (or undo the monitor's taking it back): the first stands, alone."""
    async with (
        following(amqp_url, name="isolation-first") as (broker_a, log_a),
        following(amqp_url, name="isolation-second") as (broker_b, log_b),
    ):
        endpoint = stored_endpoint("ep_" + "7" * 26, url="https://example.com/7")
        await log_a.create_many([endpoint], timeout_s=10)
        await log_b.sync(timeout_s=10)
        first = Isolation(broker_a, log_a, max_queues=BOUND, timeout_s=10)
        second = Isolation(broker_b, log_b, max_queues=BOUND, timeout_s=10)
        declare = second.ensure_queue

        async def declared_while_the_first_places_it(target: StoredEndpoint) -> None:
            await declare(target)
            assert await first.isolate(target, "slow")
            await log_b.sync(timeout_s=10)

        monkeypatch.setattr(second, "ensure_queue", declared_while_the_first_places_it)
        assert await second.isolate(endpoint, "backlogged")
        for change_log in (log_a, log_b):
            await change_log.sync(timeout_s=10)
            placed = change_log.registry.placements.placement(endpoint.id)
            assert placed is not None
            assert (placed.generation, placed.reason) == (1, "slow"), "a second placement was written"
        assert log_b.registry.placements.has_queue(endpoint.id)
        assert await queue_exists(amqp_url, topology.endpoint_queue(endpoint.id))
