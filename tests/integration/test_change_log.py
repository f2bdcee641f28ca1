"""The endpoint change log on a real RabbitMQ stream: shared, replayed, followed across reconnects."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from urllib.parse import unquote, urlsplit

import aio_pika
import pytest
from support.broker import Broker

from hookline.shared import amqp, registry, topology
from hookline.shared.models import EndpointDeleted, EndpointUpserted, SigningSecret, StoredEndpoint
from hookline.shared.signing import generate_secret

pytestmark = pytest.mark.integration
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


async def test_writes_are_seen_by_followers_and_replayed_by_newcomers(amqp_url: str) -> None:
    async with (
        amqp.connection(amqp_url, name="first", connect_timeout_s=10) as first_connection,
        amqp.connection(amqp_url, name="second", connect_timeout_s=10) as second_connection,
    ):
        await topology.declare(first_connection, event_log_max_age_s=3600)
        first, second = registry.EndpointRegistry(), registry.EndpointRegistry()
        async with (
            registry.follow(first_connection, first, sync_timeout_s=10) as writer,
            registry.follow(second_connection, second, sync_timeout_s=10) as reader,
        ):
            await writer.append(_upsert(_endpoint(1)), timeout_s=10)
            await writer.append(_upsert(_endpoint(2, "https://two.example/")), timeout_s=10)
            await writer.append(
                EndpointDeleted(change_id="chg_del", at=NOW, endpoint_id=_endpoint(1).id), timeout_s=10
            )
            # Read-your-writes on the writer, and the reader has caught up once its own marker is back.
            assert [e.id for e in first.all()] == [_endpoint(2).id]
            await reader.sync(timeout_s=10)
            assert [(e.id, e.url) for e in second.all()] == [(_endpoint(2).id, "https://two.example/")]

        late = registry.EndpointRegistry()
        async with registry.follow(second_connection, late, sync_timeout_s=10):
            assert [e.id for e in late.all()] == [_endpoint(2).id]
            assert late.last_known(_endpoint(1).id) is not None, "a deleted endpoint is remembered"


async def test_an_unreadable_record_is_skipped_and_the_rest_applied(amqp_url: str) -> None:
    async with amqp.connection(amqp_url, name="test", connect_timeout_s=10) as connection:
        await topology.declare(connection, event_log_max_age_s=3600)
        channel = await connection.channel()
        await channel.default_exchange.publish(
            aio_pika.Message(b'{"kind": "from.the.future"}'), topology.ENDPOINT_LOG
        )
        state = registry.EndpointRegistry()
        async with registry.follow(connection, state, sync_timeout_s=10) as log:
            await log.append(_upsert(_endpoint(3)), timeout_s=10)
            assert [e.id for e in state.all()] == [_endpoint(3).id]


async def test_a_follower_resumes_after_a_lost_connection_without_replaying(
    amqp_url: str, rabbitmq: Broker
) -> None:
    vhost = unquote(urlsplit(amqp_url).path.lstrip("/"))
    async with (
        amqp.connection(
            amqp_url + "?reconnect_interval=0.5", name="follower", connect_timeout_s=10
        ) as follower_connection,
        amqp.connection(
            amqp_url + "?reconnect_interval=0.5", name="writer", connect_timeout_s=10
        ) as writer_connection,
    ):
        await topology.declare(writer_connection, event_log_max_age_s=3600)
        seen: list[str] = []
        follower = registry.EndpointRegistry()
        follower.subscribe(lambda _, after: seen.append(after.url if after else "deleted"))
        async with (
            registry.follow(follower_connection, follower, sync_timeout_s=10) as follower_log,
            registry.follow(writer_connection, registry.EndpointRegistry(), sync_timeout_s=10) as writer,
        ):
            await writer.append(_upsert(_endpoint(4, "https://before.example/")), timeout_s=10)
            await follower_log.sync(timeout_s=10)
            reconnected = asyncio.Event()
            follower_connection.reconnect_callbacks.add(lambda *_: reconnected.set())
            # The broker drops every connection of this vhost, the writer's too; both reconnect.
            await asyncio.to_thread(rabbitmq.ctl, ["close_all_connections", "-p", vhost, "test"])
            await asyncio.wait_for(reconnected.wait(), 30)
            await writer_connection.connected.wait()
            await asyncio.sleep(0.5)
            await writer.append(_upsert(_endpoint(4, "https://after.example/")), timeout_s=20)
            await follower_log.sync(timeout_s=20)
        assert seen == ["https://before.example/", "https://after.example/"]
