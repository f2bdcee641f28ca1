"""The endpoint change log on a real RabbitMQ stream: shared, replayed, followed across reconnects."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path

import aio_pika
import pytest
from support import broker as test_broker
from support.changelog import following
from support.waiting import eventually

from hookline.dispatcher.catchup import CaughtUp
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import (
    EndpointDeleted,
    EndpointStatus,
    EndpointUpserted,
    EventTypeInfo,
    EventTypeUpserted,
    SigningSecret,
    StoredEndpoint,
    StoredToken,
)
from hookline.shared.outbound.signing import generate_secret
from hookline.shared.state import changefold, registry

pytestmark = [pytest.mark.integration, pytest.mark.long]
NOW = datetime.now(UTC)


def _endpoint(n: int, url: str = "https://example.com/") -> StoredEndpoint:
    return StoredEndpoint(
        id=f"ep_{n:026d}",
        tenant="acme",
        url=url,
        event_types=["#"],
        created_at=NOW,
        updated_at=NOW,
        secrets=[SigningSecret(value=generate_secret(), created_at=NOW)],
    )


def _upsert(endpoint: StoredEndpoint) -> EndpointUpserted:
    return EndpointUpserted(change_id=f"chg_{uuid.uuid4().hex}", at=NOW, endpoint=endpoint)


@asynccontextmanager
async def follow(
    amqp_url: str, state: registry.EndpointRegistry, *, name: str = "test"
) -> AsyncIterator[registry.ChangeLog]:
    """A service's view of the change log: its own connection, publisher and supervised follower (on
    the log's stream alone: nothing here routes an event)."""
    async with following(amqp_url, state, name=name, whole_topology=False) as (_, change_log):
        yield change_log


async def test_writes_are_seen_by_followers_and_replayed_by_newcomers(amqp_url: str) -> None:
    first, second = registry.EndpointRegistry(), registry.EndpointRegistry()
    async with (
        follow(amqp_url, first, name="first") as writer,
        follow(amqp_url, second, name="second") as reader,
    ):
        await writer.write(_upsert(_endpoint(1)), timeout_s=10)
        await writer.write(_upsert(_endpoint(2, "https://two.example/")), timeout_s=10)
        await writer.write(
            EndpointDeleted(change_id="chg_del", at=NOW, endpoint_id=_endpoint(1).id), timeout_s=10
        )
        # Read-your-writes on the writer, and the reader has caught up once its own marker is back.
        assert [e.id for e in first.rows.all()] == [_endpoint(2).id]
        await reader.sync(timeout_s=10)
        assert [(e.id, e.url) for e in second.rows.all()] == [(_endpoint(2).id, "https://two.example/")]

    late = registry.EndpointRegistry()
    async with follow(amqp_url, late):
        assert [e.id for e in late.rows.all()] == [_endpoint(2).id]
        assert late.deletions.last_known(_endpoint(1).id) is not None, "a deleted endpoint is remembered"


async def test_of_two_writes_based_on_one_version_exactly_one_wins_everywhere(amqp_url: str) -> None:
    first, second = registry.EndpointRegistry(), registry.EndpointRegistry()
    async with follow(amqp_url, first, name="first") as one, follow(amqp_url, second, name="second") as two:
        created = await one.upsert(_endpoint(5), base_version=0, timeout_s=10)
        assert created.version == 1
        await two.sync(timeout_s=10)
        # Both writers read version 1 and change it; the log orders them, every reader agrees.
        a = created.model_copy(update={"url": "https://a.example/"})
        b = created.model_copy(update={"url": "https://b.example/"})
        assert (await one.upsert(a, base_version=1, timeout_s=10)).url == "https://a.example/"
        with pytest.raises(registry.StaleWriteError) as stale:
            await two.upsert(b, base_version=1, timeout_s=10)
        assert stale.value.current is not None
        assert stale.value.current.version == 2
        await two.sync(timeout_s=10)
        await one.sync(timeout_s=10)
        for state in (first, second):
            current = state.get(_endpoint(5).id)
            assert current is not None
            assert (current.url, current.version) == ("https://a.example/", 2)

        # An internal writer re-reads and retries instead: its change lands on top of the winner's.
        def described(endpoint: StoredEndpoint) -> StoredEndpoint:
            return endpoint.model_copy(update={"description": "kept"})

        updated = await two.update(_endpoint(5).id, described, timeout_s=10)
        assert updated is not None
        assert (updated.url, updated.description, updated.version) == ("https://a.example/", "kept", 3)


async def test_endpoints_created_in_one_record_are_applied_each_everywhere(amqp_url: str) -> None:
    """The batch route's record: each endpoint applied as its own record would be, in order, one whose
    id exists already refused without stopping the others; a follower replaying it agrees."""
    first, second = registry.EndpointRegistry(), registry.EndpointRegistry()
    async with follow(amqp_url, first, name="first") as one, follow(amqp_url, second, name="second") as two:
        await one.upsert(_endpoint(7), base_version=0, timeout_s=10)
        results = await one.create_many([_endpoint(6), _endpoint(7), _endpoint(8)], timeout_s=10)
        assert [r.id if isinstance(r, StoredEndpoint) else "stale" for r in results] == [
            _endpoint(6).id, "stale", _endpoint(8).id,
        ]  # fmt: skip
        assert all(r.version == 1 for r in results if isinstance(r, StoredEndpoint))
        stale = results[1]
        assert isinstance(stale, changefold.Stale)
        assert stale.current is not None
        assert stale.current.id == _endpoint(7).id
        await two.sync(timeout_s=10)
        for state in (first, second):
            assert sorted(e.id for e in state.rows.all()) == [_endpoint(n).id for n in (6, 7, 8)]
    late = registry.EndpointRegistry()
    async with follow(amqp_url, late):
        assert sorted((e.id, e.version) for e in late.rows.all()) == [(_endpoint(n).id, 1) for n in (6, 7, 8)]


@pytest.mark.parametrize(
    ("status", "unless", "after"),
    [
        (EndpointStatus.ACTIVE, frozenset(), EndpointStatus.DISABLED),
        (EndpointStatus.PAUSED, frozenset(), EndpointStatus.DISABLED),  # a 410: gone, paused or not
        (EndpointStatus.PAUSED, frozenset({EndpointStatus.PAUSED}), EndpointStatus.PAUSED),  # the breaker
        (EndpointStatus.DISABLED, frozenset(), EndpointStatus.DISABLED),
    ],
)
async def test_hookline_disables_an_endpoint_unless_its_status_says_otherwise(
    amqp_url: str, status: EndpointStatus, unless: frozenset[EndpointStatus], after: EndpointStatus
) -> None:
    state = registry.EndpointRegistry()
    async with follow(amqp_url, state) as log:
        created = await log.upsert(
            _endpoint(7).model_copy(update={"status": status}), base_version=0, timeout_s=10
        )
        written = await log.disable(created.id, unless=unless, timeout_s=10)
        current = state.get(created.id)
        assert current is not None
        assert current.status is after
        assert (written is not None) == (status is not after)
        assert current.version == created.version + (1 if written else 0)
    # A deleted endpoint stays deleted.
    async with follow(amqp_url, state) as log:
        await log.write(
            EndpointDeleted(
                change_id=new_id("chg"), at=NOW, endpoint_id=created.id, base_version=current.version
            ),
            timeout_s=10,
        )
        assert await log.disable(created.id, unless=frozenset(), timeout_s=10) is None
        assert state.get(created.id) is None


async def test_an_unreadable_record_is_skipped_and_the_rest_applied(amqp_url: str) -> None:
    async with Broker(amqp_url, name="raw", connect_timeout_s=10) as broker, broker.channel() as channel:
        await topology.endpoint_log(channel)
        await channel.default_exchange.publish(
            aio_pika.Message(b'{"kind": "from.the.future"}'), topology.ENDPOINT_LOG
        )
    state = registry.EndpointRegistry()
    async with follow(amqp_url, state) as log:
        await log.write(_upsert(_endpoint(3)), timeout_s=10)
        assert [e.id for e in state.rows.all()] == [_endpoint(3).id]


async def test_a_registry_file_built_past_a_newer_record_is_built_again_once_upgraded(
    amqp_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dispatcher not yet upgraded skips what a newer ingest wrote; its file then says so, and the
    upgraded dispatcher reads the whole log again instead of resuming past that record for good."""
    vhost = test_broker.vhost_of(amqp_url)
    path = tmp_path / "dispatcher.registry.sqlite"
    newer = _upsert(_endpoint(2)).model_dump(mode="json")
    newer["endpoint"]["a_field_of_a_newer_version"] = True
    async with registry.kept_at(path, vhost=vhost) as kept, follow(amqp_url, kept, name="older") as log:
        await log.write(_upsert(_endpoint(1)), timeout_s=10)
        async with (
            Broker(amqp_url, name="newer", connect_timeout_s=10) as broker,
            broker.channel() as channel,
        ):
            await channel.default_exchange.publish(
                aio_pika.Message(json.dumps(newer).encode()), topology.ENDPOINT_LOG
            )
        await log.write(_upsert(_endpoint(3)), timeout_s=10)
        assert [e.id for e in kept.rows.all()] == [_endpoint(1).id, _endpoint(3).id], "the newer one skipped"

    async def read_at_start() -> list[str]:
        seen: list[str] = []
        async with registry.kept_at(path, vhost=vhost) as kept:
            kept.subscribe(lambda _, after: seen.extend([after.id] if after else []))
            async with follow(amqp_url, kept, name="restarted") as log:
                await log.sync(timeout_s=10)
        return seen

    assert await read_at_start() == [], "the same version resumes: it would skip that record again"
    monkeypatch.setattr(registry, "readable_records", lambda: "a newer version's")
    assert await read_at_start() == [_endpoint(1).id, _endpoint(3).id], "read again from the first"
    assert await read_at_start() == [], "once"


async def test_a_follower_resumes_after_a_lost_connection_without_replaying(
    amqp_url: str, rabbitmq: test_broker.Broker
) -> None:
    vhost = test_broker.vhost_of(amqp_url)
    seen: list[str] = []
    follower = registry.EndpointRegistry()
    follower.subscribe(lambda _, after: seen.append(after.url if after else "deleted"))
    async with (
        follow(amqp_url, follower, name="follower") as follower_log,
        follow(amqp_url, registry.EndpointRegistry(), name="writer") as writer,
    ):
        await writer.write(_upsert(_endpoint(4, "https://before.example/")), timeout_s=10)
        await follower_log.sync(timeout_s=10)
        # The broker drops every connection of this vhost, the writer's too; both connect again.
        await rabbitmq.ctl_async(["close_all_connections", "-p", vhost, "test"])

        async def written() -> bool:
            try:
                await writer.write(_upsert(_endpoint(4, "https://after.example/")), timeout_s=2)
            except (TimeoutError, ConnectionError, aio_pika.exceptions.AMQPError):
                return False
            return True

        await eventually(written, timeout_s=30)
        await follower_log.sync(timeout_s=20)
    assert seen == ["https://before.example/", "https://after.example/"]


async def test_a_registry_kept_on_disk_resumes_where_it_was_and_keeps_following(
    amqp_url: str, tmp_path: Path
) -> None:
    """A service restarted with its registry file reads no record twice and misses none written while
    it was down; the event types and tokens it kept come back with it."""
    vhost = test_broker.vhost_of(amqp_url)
    path = tmp_path / "ingest.registry.sqlite"
    token = StoredToken(
        id="tok_" + "1" * 26, tenant="acme", digest="d" * 64, created_at=NOW, prefix="hlt_abcd"
    )
    async with registry.kept_at(path, vhost=vhost) as kept, follow(amqp_url, kept, name="first") as log:
        await log.write(_upsert(_endpoint(1)), timeout_s=10)
        await log.write(_upsert(_endpoint(2)), timeout_s=10)
        await log.write_token(token, timeout_s=10)
        event_type = EventTypeInfo(
            name="order.created", description="an order", created_at=NOW, updated_at=NOW
        )
        await log.write_event_type(
            EventTypeUpserted(change_id=new_id("chg"), at=NOW, event_type=event_type), timeout_s=10
        )
        offset_before = log.applied_offset
    async with follow(amqp_url, registry.EndpointRegistry(), name="writer") as writer:
        await writer.write(
            EndpointDeleted(change_id=new_id("chg"), at=NOW, endpoint_id=_endpoint(1).id), timeout_s=10
        )
        await writer.write(_upsert(_endpoint(3)), timeout_s=10)

    seen: list[str] = []
    async with registry.kept_at(path, vhost=vhost) as kept:
        kept.subscribe(lambda before, after: seen.extend(e.id for e in (after or before,) if e is not None))
        async with follow(amqp_url, kept, name="again") as log:
            assert [e.id for e in kept.rows.all()] == [_endpoint(2).id, _endpoint(3).id]
            assert seen == [_endpoint(1).id, _endpoint(3).id], "only the records written while it was down"
            assert log.tenants.token(token.id) == token
            kept_type = log.catalog.get("order.created")
            assert kept_type is not None
            assert kept_type.description == "an order"
            assert offset_before is not None
            assert log.applied_offset is not None
            assert log.applied_offset > offset_before
            await log.write(_upsert(_endpoint(4)), timeout_s=10)
            assert kept.get(_endpoint(4).id) is not None, "and follows on"


async def test_callers_catching_up_at_once_share_their_markers_and_see_what_was_written_before(
    amqp_url: str,
) -> None:
    """A dispatcher whose catalog refuses a whole burst of events reads the log up to now before each
    refusal: fifty at once write one marker between them, not fifty, fifty more after them one more, and
    each sees what another process wrote before it called."""
    async with (
        follow(amqp_url, registry.EndpointRegistry(), name="writer") as writer,
        follow(amqp_url, registry.EndpointRegistry(), name="behind") as behind,
    ):
        await behind.sync(timeout_s=10)
        before = behind.applied_offset
        assert before is not None
        relaxed = EventTypeInfo(
            name="payment.captured", description="relaxed", created_at=NOW, updated_at=NOW
        )
        await writer.write_event_type(
            EventTypeUpserted(change_id=new_id("chg"), at=NOW, event_type=relaxed), timeout_s=10
        )
        caught_up = CaughtUp(behind)
        await asyncio.gather(*(caught_up.wait(timeout_s=10) for _ in range(50)))
        await asyncio.gather(*(caught_up.wait(timeout_s=10) for _ in range(50)))
        known = behind.catalog.get("payment.captured")
        assert known is not None
        assert known.description == "relaxed"
        assert behind.applied_offset is not None
        # The type's record, and a marker for each fifty.
        assert behind.applied_offset - before == 3
