"""Dead-letter records read back from the stream (ours, and the broker's delivery-limit ones), and the
index kept of them in SQLite: what it lists, analyses, forgets, and what it resumes from."""

from __future__ import annotations

import asyncio
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from hookline.shared.broker.topology import delay_routing_key, route_exchange
from hookline.shared.broker.views import ViewSchema, ViewStore, continues, rebuild_reason
from hookline.shared.contracts.deadletters import (
    REDRIVEN_HEADER,
    DeadLetterAnalysis,
    DeadLetterItem,
    dead_letter_message,
    item_id,
    offset_of,
    read_item,
)
from hookline.shared.contracts.models import DeadLetterReason
from hookline.shared.state.deadletterindex import DeadLetterIndex

NOW = datetime(2026, 11, 29, 18, 0, tzinfo=UTC)
BODY = b'{"id": "evt_1", "type": "order.created", "tenant": "acme"}'
IDENTITY = "/hookline.dead-letters"


@dataclass
class FakeMessage:
    """What a stream follower hands to ``apply``: enough of an aio-pika incoming message."""

    body: bytes
    headers: dict[str, Any] = field(default_factory=dict)
    message_id: str | None = None
    timestamp: datetime | None = None
    routing_key: str | None = None
    user_id: str | None = None


def dead(
    offset: int,
    *,
    endpoint_id: str = "ep_1",
    tenant: str | None = "acme",
    event_id: str | None = None,
    reason: DeadLetterReason = DeadLetterReason.MAX_ATTEMPTS,
    attempts: int = 7,
    last_status: int | None = 503,
    last_error: str = "HTTP 503: busy",
    at: datetime = NOW,
) -> FakeMessage:
    message = dead_letter_message(
        BODY, reason=reason, endpoint_id=endpoint_id, tenant=tenant, event_id=event_id or f"evt_{offset}",
        attempts=attempts, last_status=last_status, last_error=last_error, now=at,
    )  # fmt: skip
    return FakeMessage(message.body, {**message.headers, "x-stream-offset": offset}, message.message_id)


def redriven(offset: int, *ids: str) -> FakeMessage:
    body = orjson.dumps({"ids": ids})
    return FakeMessage(body, {REDRIVEN_HEADER: len(ids), "x-stream-offset": offset}, f"redrive_{offset}")


async def listed(index: DeadLetterIndex, **filters: Any) -> list[str]:
    return [item.id for item in await index.select(**filters)]


@pytest.fixture
async def index() -> AsyncIterator[DeadLetterIndex]:
    async with DeadLetterIndex() as opened:
        yield opened


# --- reading one record -----------------------------------------------------------------------------


def test_our_dead_letters_round_trip() -> None:
    message = dead_letter_message(
        BODY, reason=DeadLetterReason.MAX_ATTEMPTS, endpoint_id="ep_1", tenant="acme", event_id="evt_1",
        attempts=7, last_status=503, last_error="HTTP 503: busy" + "x" * 1000, now=NOW,
    )  # fmt: skip
    item = read_item(12, message.body, message.headers, message_id=message.message_id, timestamp=None)
    assert item.model_dump() == {
        "id": "dl_12", "event_id": "evt_1", "endpoint_id": "ep_1", "tenant": "acme", "type": "order.created",
        "reason": DeadLetterReason.MAX_ATTEMPTS, "attempts": 7, "last_status": 503,
        "last_error": ("HTTP 503: busy" + "x" * 1000)[:500], "dead_at": NOW,
    }  # fmt: skip


def test_an_invalid_body_is_listed_without_type() -> None:
    message = dead_letter_message(
        b"\xff not json", reason=DeadLetterReason.INVALID_EVENT, endpoint_id="ep_1", tenant="acme",
        event_id=None, attempts=0, last_status=None, last_error="Invalid JSON", now=NOW,
    )  # fmt: skip
    item = read_item(3, message.body, message.headers, message_id=None, timestamp=None)
    assert (item.type, item.event_id, item.tenant, item.reason) == (
        None,
        None,
        "acme",
        DeadLetterReason.INVALID_EVENT,
    )


def test_a_broker_delivery_limit_dead_letter() -> None:
    headers = {
        "x-first-death-queue": "hookline.endpoint.ep_01ABC",
        "x-first-death-reason": "delivery_limit",
        "x-hookline-attempt": 3,
    }
    item = read_item(5, BODY, headers, message_id="evt_1", timestamp=NOW)
    assert (item.reason, item.endpoint_id, item.event_id, item.tenant, item.attempts, item.dead_at) == (
        DeadLetterReason.DELIVERY_LIMIT, "ep_01ABC", "evt_1", "acme", 3, NOW,
    )  # fmt: skip
    assert "delivery_limit" in item.last_error


def test_a_retry_over_the_delivery_limit_is_listed_under_its_endpoint() -> None:
    """A retry copy first "died" by expiring in a delay queue; the routing key it came back with names
    the endpoint's route exchange, so the dead letter is still the endpoint's (listable, redrivable)."""
    headers = {
        "x-first-death-queue": "hookline.delay.00",
        "x-first-death-reason": "expired",
        "x-hookline-attempt": 4,
    }
    routing_key = delay_routing_key(1, route_exchange("ep_01ABC"))
    item = read_item(6, BODY, headers, message_id="evt_1", timestamp=NOW, routing_key=routing_key)
    assert (item.reason, item.endpoint_id, item.attempts) == (DeadLetterReason.DELIVERY_LIMIT, "ep_01ABC", 4)
    assert "expired" not in item.last_error


def test_ids_are_offsets() -> None:
    assert item_id(42) == "dl_42"
    assert offset_of("dl_42") == 42
    assert offset_of("dl_x") is None
    assert offset_of("42") is None


# --- the index ------------------------------------------------------------------------------------


async def test_the_index_lists_what_it_read_as_read_item_reads_it(index: DeadLetterIndex) -> None:
    message = dead(12, last_error="HTTP 503: busy" + "x" * 1000)
    index.apply(message)
    assert index.pending == 1
    [item] = await index.select()
    assert item == read_item(12, message.body, message.headers, message_id=message.message_id, timestamp=None)
    assert index.pending == 0, "a read writes what was buffered first"


async def test_reopening_the_file_gives_the_same_listing_and_resumes_after_the_last_offset(
    tmp_path: Path,
) -> None:
    path = tmp_path / "dead-letters.sqlite"
    async with DeadLetterIndex(path, identity=IDENTITY) as index:
        assert index.next_offset == "first"
        for offset in (3, 4, 7):
            index.apply(dead(offset, endpoint_id=f"ep_{offset % 2}"))
        before = await index.select()
        last = dead(9)
        index.apply(last)  # left in the buffer: written when the index closes
    async with DeadLetterIndex(path, identity=IDENTITY) as index:
        assert index.next_offset == 10
        assert index.last_applied == (9, last.message_id)
        assert (await index.select())[:3] == before
        assert await listed(index) == ["dl_3", "dl_4", "dl_7", "dl_9"]


async def test_a_record_read_again_is_not_applied_again(index: DeadLetterIndex) -> None:
    index.apply(dead(1))
    index.apply(redriven(2, "dl_1"))
    index.apply(dead(1))  # a consumer re-attached at an earlier offset
    assert await listed(index) == []
    assert index.next_offset == 3


async def test_a_redrive_record_removes_what_it_names(index: DeadLetterIndex) -> None:
    for offset in range(1, 6):
        index.apply(dead(offset))
    await index.flush()
    index.apply(dead(6))
    # Named: one already written, one still buffered, one unknown, one that is not an id.
    index.apply(redriven(7, "dl_2", "dl_6", "dl_99", "evt_1"))
    assert await listed(index) == ["dl_1", "dl_3", "dl_4", "dl_5"]
    index.apply(redriven(8, "dl_1", "dl_5"))
    assert await index.count() == 2, "a read sees the redrive record just applied"


async def test_unreadable_records_are_skipped_but_their_offset_counts(index: DeadLetterIndex) -> None:
    index.apply(FakeMessage(b"{}", {"x-hookline-reason": "no such reason", "x-stream-offset": 4}))
    index.apply(FakeMessage(b"not json", {REDRIVEN_HEADER: 1, "x-stream-offset": 5}))
    index.apply(FakeMessage(b"{}", {}))  # no offset: not from the stream
    await index.flush()
    assert await index.count() == 0
    assert index.last_applied == (5, None)


async def test_paging_with_after(index: DeadLetterIndex) -> None:
    for offset in range(10, 20):
        index.apply(dead(offset, endpoint_id="ep_a" if offset % 2 else "ep_b"))
    first = await listed(index, endpoint_id="ep_a", limit=3)
    second = await listed(index, endpoint_id="ep_a", limit=3, after=first[-1])
    assert (first, second) == (["dl_11", "dl_13", "dl_15"], ["dl_17", "dl_19"])
    assert await listed(index, after="dl_17") == ["dl_18", "dl_19"]
    assert await listed(index, after="dl_19") == []


async def test_filters_are_all_applied(index: DeadLetterIndex) -> None:
    index.apply(dead(1, endpoint_id="ep_a", tenant="acme", event_id="evt_x"))
    index.apply(dead(2, endpoint_id="ep_a", tenant="umbrella", reason=DeadLetterReason.PERMANENT_STATUS))
    index.apply(dead(3, endpoint_id="ep_b", tenant="acme", reason=DeadLetterReason.PERMANENT_STATUS))
    index.apply(dead(4, endpoint_id="ep_b", tenant="umbrella", event_id="evt_x"))
    assert await listed(index, endpoint_id="ep_a") == ["dl_1", "dl_2"]
    assert await listed(index, tenant="acme") == ["dl_1", "dl_3"]
    assert await listed(index, reason=DeadLetterReason.PERMANENT_STATUS) == ["dl_2", "dl_3"]
    assert await listed(index, event_id="evt_x") == ["dl_1", "dl_4"]
    assert await listed(index, endpoint_id="ep_b", event_id="evt_x") == ["dl_4"]
    assert await listed(index, ids={"dl_4", "dl_2", "dl_99", "bogus"}) == ["dl_2", "dl_4"]
    assert await listed(index, ids=set()) == []
    assert await listed(index, tenant="acme", reason=DeadLetterReason.PERMANENT_STATUS, ids=["dl_3"]) == [
        "dl_3"
    ]
    assert (await index.count(), await index.count(tenant="acme"), await index.count(tenant="none")) == (
        4,
        2,
        0,
    )


async def test_analysis_per_endpoint(index: DeadLetterIndex) -> None:
    at = [NOW + timedelta(minutes=m) for m in range(6)]
    index.apply(
        dead(1, endpoint_id="ep_a", last_status=503, last_error="HTTP 503: busy", attempts=7, at=at[2])
    )
    index.apply(dead(2, endpoint_id="ep_b", last_status=None, last_error="timeout", attempts=1, at=at[0]))
    index.apply(dead(3, endpoint_id="ep_a", last_status=404, last_error="HTTP 404" + "!" * 200, attempts=1,
                     reason=DeadLetterReason.PERMANENT_STATUS, at=at[1]))  # fmt: skip
    index.apply(dead(4, endpoint_id="ep_a", last_status=404, last_error="HTTP 404" + "!" * 300, attempts=1,
                     reason=DeadLetterReason.PERMANENT_STATUS, at=at[5]))  # fmt: skip
    index.apply(dead(5, endpoint_id="ep_b", tenant="umbrella", last_status=None, attempts=2, at=at[3]))
    assert await index.analysis() == [
        DeadLetterAnalysis(
            endpoint_id="ep_a", tenant="acme", count=3, most_common_reason=DeadLetterReason.PERMANENT_STATUS,
            most_common_error="HTTP 404" + "!" * 112, most_common_status=404, first_at=at[1], last_at=at[5],
            mean_attempts=3.0,
        ),
        DeadLetterAnalysis(
            endpoint_id="ep_b", tenant="acme", count=2, most_common_reason=DeadLetterReason.MAX_ATTEMPTS,
            most_common_error="timeout", most_common_status=None, first_at=at[0], last_at=at[3],
            mean_attempts=1.5,
        ),
    ]  # fmt: skip
    [umbrella] = await index.analysis(tenant="umbrella")
    assert (umbrella.endpoint_id, umbrella.tenant, umbrella.count) == ("ep_b", "umbrella", 1)
    assert await index.analysis(tenant="nobody") == []


def reference_analysis(items: list[DeadLetterItem], tenant: str | None) -> list[DeadLetterAnalysis]:
    """The in-memory analysis the SQL one replaced, kept as the oracle."""
    groups: dict[str | None, list[DeadLetterItem]] = {}
    for item in items:
        if tenant is None or item.tenant == tenant:
            groups.setdefault(item.endpoint_id, []).append(item)

    def most_common(values: list[Any]) -> Any:
        return Counter(values).most_common(1)[0][0] if values else None

    return [
        DeadLetterAnalysis(
            endpoint_id=endpoint_id,
            tenant=group[0].tenant,
            count=len(group),
            most_common_reason=most_common([item.reason for item in group]),
            most_common_error=most_common([item.last_error[:120] for item in group]),
            most_common_status=most_common([item.last_status for item in group if item.last_status]),
            first_at=min(item.dead_at for item in group),
            last_at=max(item.dead_at for item in group),
            mean_attempts=round(sum(item.attempts for item in group) / len(group), 2),
        )
        for endpoint_id, group in sorted(groups.items(), key=lambda entry: -len(entry[1]))
    ]


letters = st.lists(
    st.fixed_dictionaries(
        {
            "endpoint_id": st.sampled_from(["ep_a", "ep_b", "ep_c", ""]),
            "tenant": st.sampled_from(["acme", "umbrella", None]),
            "reason": st.sampled_from([DeadLetterReason.MAX_ATTEMPTS, DeadLetterReason.PERMANENT_STATUS]),
            "attempts": st.integers(0, 9),
            "last_status": st.sampled_from([None, 0, 404, 503]),
            "last_error": st.sampled_from(["timeout", "HTTP 503", "é" * 130, "é" * 125 + "x"]),
            "at": st.integers(0, 3_600).map(lambda s: NOW + timedelta(seconds=s)),
        }
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(letters, st.sampled_from([None, "acme", "umbrella"]))
def test_the_sql_analysis_is_the_in_memory_one(fields: list[dict[str, Any]], tenant: str | None) -> None:
    messages = [dead(offset, **values) for offset, values in enumerate(fields)]

    async def analyse() -> list[DeadLetterAnalysis]:
        async with DeadLetterIndex() as index:
            for message in messages:
                index.apply(message)
            return await index.analysis(tenant=tenant)

    items = [read_item(m.headers["x-stream-offset"], m.body, m.headers, message_id=None, timestamp=None)
             for m in messages]  # fmt: skip
    assert asyncio.run(analyse()) == reference_analysis(items, tenant)


async def test_counts_since(index: DeadLetterIndex) -> None:
    since = NOW - timedelta(minutes=5)
    index.apply(dead(1, endpoint_id="ep_a", at=since - timedelta(microseconds=1)))
    index.apply(dead(2, endpoint_id="ep_a", at=since))
    index.apply(dead(3, endpoint_id="ep_b", at=NOW))
    index.apply(dead(4, endpoint_id="ep_b", at=NOW))
    index.apply(dead(5, endpoint_id="", at=NOW))  # no endpoint: not counted against one
    assert await index.counts_since(since) == Counter({"ep_b": 2, "ep_a": 1})
    assert await index.counts_since(since.replace(tzinfo=None)) == Counter({"ep_b": 2, "ep_a": 1})


async def test_expire_forgets_what_died_before(index: DeadLetterIndex) -> None:
    index.apply(dead(1, at=NOW - timedelta(days=31)))
    index.apply(dead(2, at=NOW - timedelta(days=30)))
    index.apply(dead(3, at=NOW))
    assert await index.expire(NOW - timedelta(days=30)) == 1
    assert await listed(index) == ["dl_2", "dl_3"]
    assert index.next_offset == 4, "expiring rows does not move the offset"


async def test_another_identity_rebuilds_the_view(tmp_path: Path) -> None:
    path = tmp_path / "dead-letters.sqlite"
    async with DeadLetterIndex(path, identity="/hookline.dead-letters") as index:
        index.apply(dead(1))
    with capture_logs() as logs:
        async with DeadLetterIndex(path, identity="/other-vhost/hookline.dead-letters") as index:
            assert (index.next_offset, index.last_applied, await index.count()) == ("first", None, 0)
    [rebuilt] = [entry for entry in logs if entry["event"] == "view_rebuilt"]
    assert "identity" in rebuilt["reason"]


async def test_reset_empties_the_view(index: DeadLetterIndex) -> None:
    index.apply(dead(1))
    index.apply(dead(2))
    await index.flush()
    index.apply(dead(3))
    await index.reset(reason="stream recreated")
    assert (index.next_offset, index.pending, await index.count()) == ("first", 0, 0)
    index.apply(dead(0))  # the new stream starts again at 0
    assert await listed(index) == ["dl_0"]


# --- the store underneath -------------------------------------------------------------------------

SCHEMA_V1 = ViewSchema(version=1, statements=["CREATE TABLE things (n INTEGER PRIMARY KEY)"])


def insert(n: int) -> Any:
    return lambda db: db.execute("INSERT INTO things (n) VALUES (?)", (n,))


def things(db: sqlite3.Connection) -> list[int]:
    return [n for (n,) in db.execute("SELECT n FROM things ORDER BY n")]


async def test_another_schema_version_rebuilds_the_store(tmp_path: Path) -> None:
    path = tmp_path / "view.sqlite"
    async with ViewStore(path, schema=SCHEMA_V1, identity="s") as store:
        await store.write(insert(1), applied=(0, "m0"))
    async with ViewStore(path, schema=SCHEMA_V1, identity="s") as store:
        assert (store.last_applied, store.next_offset, await store.read(things)) == ((0, "m0"), 1, [1])
    v2 = ViewSchema(version=2, statements=["CREATE TABLE things (n INTEGER PRIMARY KEY, label TEXT)"])
    with capture_logs() as logs:
        async with ViewStore(path, schema=v2, identity="s") as store:
            assert (store.last_applied, await store.read(things)) == (None, [])
    assert [entry["reason"] for entry in logs if entry["event"] == "view_rebuilt"] == [
        "schema version 1 != 2"
    ]


async def test_a_failed_write_leaves_neither_rows_nor_offset() -> None:
    def half_then_fail(db: sqlite3.Connection) -> None:
        insert(2)(db)
        raise RuntimeError("disk on fire")

    async with ViewStore(None, schema=SCHEMA_V1, identity="s") as store:
        await store.write(insert(1), applied=(5, None))
        with pytest.raises(RuntimeError):
            await store.write(half_then_fail, applied=(6, None))
        assert (store.last_applied, await store.read(things)) == ((5, None), [1])
        with pytest.raises(ValueError, match="before the applied offset"):
            await store.write(insert(3), applied=(4, None))


async def test_a_file_that_is_not_a_view_is_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "view.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE meta (whatever TEXT)")
        db.execute('CREATE TABLE "odd ""name" (x)')
    db.close()
    async with ViewStore(path, schema=SCHEMA_V1, identity="s") as store:
        await store.write(insert(1), applied=(0, None))
        assert await store.read(
            lambda db: sorted(r[0] for r in db.execute("SELECT name FROM sqlite_master"))
        ) == [
            "meta",
            "things",
        ]


async def test_a_closed_store_refuses_work() -> None:
    store = ViewStore(None, schema=SCHEMA_V1, identity="s")
    with pytest.raises(RuntimeError, match="not open"):
        await store.read(things)


@pytest.mark.parametrize(
    ("stored", "has_tables", "expected"),
    [
        (("s", 1), True, None),
        (None, False, "new file"),
        (None, True, "unreadable view metadata"),
        (("t", 1), True, "identity 't' != 's'"),
        (("s", 2), True, "schema version 2 != 1"),
    ],
)
def test_rebuild_reason(stored: tuple[str, int] | None, has_tables: bool, expected: str | None) -> None:
    assert rebuild_reason(stored, identity="s", schema_version=1, has_tables=has_tables) == expected


@pytest.mark.parametrize(
    ("last_applied", "offset", "message_id", "expected"),
    [
        (None, 0, "m", True),  # nothing applied yet: any stream will do
        ((41, "m41"), 41, "m41", True),
        ((41, "m41"), 41, "other", False),  # the stream was recreated and grew past the offset
        ((41, "m41"), 3, "m3", False),  # recreated, shorter: the broker started at its end
        ((41, "m41"), 42, "m42", False),  # retention removed the record the view stopped at
    ],
)
def test_continues(
    last_applied: tuple[int, str] | None, offset: int, message_id: str, expected: bool
) -> None:
    assert continues(last_applied, offset, message_id) is expected
