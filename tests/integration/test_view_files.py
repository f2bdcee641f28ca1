"""A view whose file is found damaged while the service runs (a page SQLite reads only for a query) is
set aside and read again from its stream's first record, by the loop that follows it, on a real stream."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import aio_pika
import pytest
from structlog.testing import capture_logs
from support.waiting import eventually

from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.broker.streams import StreamFollower, follow_synced
from hookline.shared.broker.views import follow_view
from hookline.shared.contracts.deadletters import dead_letter_message
from hookline.shared.contracts.models import DeadLetterReason
from hookline.shared.runtime.supervision import Supervisor
from hookline.shared.state.deadletterindex import DeadLetterIndex
from hookline.shared.state.statefiles import StateFileReplacedError

pytestmark = pytest.mark.integration
#: Enough dead letters (with their error texts) that the file spans a few hundred pages.
DEAD = 2_000


@asynccontextmanager
async def followed(amqp_url: str, path: Path) -> AsyncIterator[tuple[DeadLetterIndex, Supervisor]]:
    """The dead-letter index as a service keeps it: its file, followed under a supervisor, caught up."""
    supervisor = Supervisor()
    async with (
        Broker(amqp_url, name="views", connect_timeout_s=10) as broker,
        DeadLetterIndex(path, identity=f"{broker.vhost}/{topology.DEAD_LETTER_STREAM}") as index,
    ):
        await topology.declare(broker, topology.Retention(event_log_max_age_s=3600))
        publisher = Publisher(broker)
        follower = StreamFollower(
            broker, topology.DEAD_LETTER_STREAM, index.apply, publisher=publisher, start=index.next_offset
        )
        try:
            view = partial(follow_view, follower, index)
            await follow_synced(supervisor, "dead-letters", follower, view, timeout_s=10)
            yield index, supervisor
        finally:
            await supervisor.stop()
            await publisher.close()


async def publish_dead_letters(amqp_url: str, count: int) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        now = datetime.now(UTC)
        for start in range(0, count, 200):
            await asyncio.gather(
                *(
                    channel.default_exchange.publish(
                        dead_letter_message(
                            b'{"id": "evt_%d", "type": "a.b", "tenant": "acme"}' % n,
                            reason=DeadLetterReason.MAX_ATTEMPTS,
                            endpoint_id=f"ep_{n % 7}",
                            tenant="acme",
                            event_id=f"evt_{n}",
                            attempts=7,
                            last_status=503,
                            last_error="upstream said " * 20,
                            now=now,
                        ),
                        routing_key=topology.DEAD_LETTER_STREAM,
                    )
                    for n in range(start, min(start + 200, count))
                )
            )


def damage_the_middle(path: Path) -> None:
    size = path.stat().st_size
    with path.open("r+b") as file:
        file.seek(size // 4)
        file.write(os.urandom(size // 2))


async def test_a_view_found_damaged_in_use_is_read_again_from_its_stream(
    amqp_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "ingest.sqlite"
    async with followed(amqp_url, tmp_path / "seed.sqlite"):
        pass  # declares the topology
    await publish_dead_letters(amqp_url, DEAD)
    async with followed(amqp_url, path) as (index, _):
        assert await index.count() == DEAD
        applied_up_to = index.next_offset
    # Closed cleanly (its log folded into it), then a page in the middle is damaged: the header and the
    # schema are intact, so the file opens, and only a query reaching that page finds it.
    damage_the_middle(path)
    with capture_logs() as logs:
        async with followed(amqp_url, path) as (index, supervisor):
            assert index.next_offset == applied_up_to, "opened as it was"
            with pytest.raises(StateFileReplacedError):
                await index.select()
            # The follower's loop sees it at its next flush, resets the view and reads the stream again.

            async def rebuilt() -> bool:
                try:
                    return len(await index.select()) == DEAD
                except StateFileReplacedError:
                    return False  # not reset yet

            await eventually(rebuilt, timeout_s=30)
            assert supervisor.loops["dead-letters"].restarts == 1
            assert index.next_offset == applied_up_to
    assert [
        entry["event"] for entry in logs if entry["event"] in {"state_file_set_aside", "view_rebuilt"}
    ] == [
        "state_file_set_aside",
        "view_rebuilt",
    ]
    assert aside(tmp_path)


def aside(directory: Path) -> list[Path]:
    return list(directory.glob("ingest.sqlite.corrupt-*Z"))
