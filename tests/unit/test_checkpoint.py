"""The monitor's checkpoint: a loaded Health gives the same figures and breakers as the one dumped; the
store gives back what it saved, for the same stream only; prune() keeps memory bounded."""

from __future__ import annotations

import dataclasses
import random
import sqlite3
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import orjson
import pytest
from structlog.testing import capture_logs

from hookline.health_monitor.alerts import Alert
from hookline.health_monitor.breaker import BreakerPolicy
from hookline.health_monitor.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointStore,
    dump,
    dump_alerts,
    load,
    load_alerts,
)
from hookline.health_monitor.health import (
    MAX_TRACKED_RETRIES,
    OTHER_TYPES,
    EndpointHealth,
    Health,
    HealthPolicy,
    TypeHealth,
)
from hookline.health_monitor.stats import RollingStats
from hookline.shared.contracts.control import BreakerCommand, BreakerState
from hookline.shared.contracts.telemetry import AttemptRecord, Heartbeat

POLICY = HealthPolicy(breaker=BreakerPolicy(failure_threshold=5, cooldown_s=60, max_cooldown_s=600))
NOW = 1_700_000_000.0 + 1_800  # half past an hour: the day window starts 23.5 h back
HOUR = 3_600.0


def record(at_s: float, **fields: Any) -> AttemptRecord:
    values: dict[str, Any] = {
        "at_s": at_s, "dispatcher_id": "d1", "event_id": "e", "endpoint_id": "ep_a", "tenant": "t",
        "type": "order.created", "attempt": 1, "outcome": "success", "status": 204, "error": None,
        "duration_ms": 10.0, "first_attempt_at_s": at_s,
    }  # fmt: skip
    values.update(fields)
    return AttemptRecord(**values)


def heartbeat(dispatcher_id: str, at_s: float) -> Heartbeat:
    return Heartbeat(at_s=at_s, dispatcher_id=dispatcher_id, in_flight=3, consumers=2)


def busy_health() -> Health:
    """A few hundred records over a day for several endpoints and types; one breaker open, one half-open
    with a probe assigned, some events awaiting a retry."""
    health = Health(POLICY)
    rng = random.Random(7)
    for n in range(600):
        at_s = NOW - 86_000 + n * 143.0
        status, outcome, error = rng.choice(
            [(204, "success", None)] * 6
            + [(503, "retry", None), (None, "retry", "timeout"), (401, "permanent", None)]
        )
        health.observe(
            record(
                at_s,
                endpoint_id=rng.choice(["ep_a", "ep_b", "ep_c", "ep_d"]),
                type=rng.choice(["order.created", "order.paid", "user.deleted"]),
                event_id=f"e{rng.randrange(200)}",
                attempt=rng.randint(1, 6),
                outcome=outcome,
                status=status,
                error=error,
                duration_ms=rng.lognormvariate(4, 1.2),
                first_attempt_at_s=at_s - rng.uniform(0, 3_000),
                dead_letter_reason="permanent_status" if outcome == "permanent" else None,
            ),
            now_s=at_s,
            live=False,
        )
    health.observe(heartbeat("d1", NOW - 335), now_s=NOW - 335, live=False)
    health.observe(heartbeat("d2", NOW - 3 * HOUR), now_s=NOW - 400, live=False)
    for n in range(5):  # ep_b fails live: its breaker opens, and half-opens when the cooldown ends
        failed = record(NOW - 400 + n, endpoint_id="ep_b", outcome="retry", status=500, event_id=f"b{n}")
        health.observe(failed, now_s=NOW - 400 + n, live=True)
    health.tick(now_s=NOW - 330)
    for n in range(5):  # ep_c fails later: open, its cooldown still running
        failed = record(NOW - 60 + n, endpoint_id="ep_c", outcome="retry", status=500, event_id=f"c{n}")
        health.observe(failed, now_s=NOW - 60 + n, live=True)
    return health


def figures(health: Health, *, now_s: float) -> dict[str, Any]:
    """What a Health shows: every window's counters and percentiles, breakers, retries, dispatchers."""

    def window(stats: RollingStats) -> tuple[Any, ...]:
        total = stats.total(now_s=now_s)
        counters = dataclasses.astuple(dataclasses.replace(total, sketch=None))  # type: ignore[arg-type]
        percentiles = tuple(total.percentile_ms(q) for q in (0.5, 0.95, 0.99))
        return counters, percentiles, sorted(total.sketch.bins.items()), total.sketch.count

    return {
        "endpoints": {
            endpoint_id: (
                window(e.day),
                window(e.hour),
                window(e.recent),
                e.breaker,
                e.command,
                list(e.retrying.items()),
                e.last_attempt_at_s,
                e.probe_asked_at_s,
            )
            for endpoint_id, e in health.endpoints.items()
        },
        "types": {
            event_type: (window(t.day), window(t.recent), t.last_attempt_at_s)
            for event_type, t in health.types.items()
        },
        "dispatchers": health.dispatchers,
        "live": health.live_dispatchers(now_s),
    }


def test_a_loaded_health_shows_the_same_figures_and_breakers() -> None:
    health = busy_health()
    assert health.endpoints["ep_b"].breaker.state is BreakerState.HALF_OPEN
    assert health.endpoints["ep_b"].command is not None
    assert health.endpoints["ep_b"].command.probe_by == "d1"
    assert health.endpoints["ep_c"].breaker.state is BreakerState.OPEN
    assert health.endpoints["ep_a"].retrying

    loaded = load(dump(health), policy=POLICY)

    assert figures(loaded, now_s=NOW) == figures(health, now_s=NOW)
    assert loaded.endpoints["ep_a"].day.total(now_s=NOW).attempts > 100
    assert dump(loaded) == dump(health)  # nothing lost, nothing reordered
    assert loaded.policy is POLICY


def test_a_loaded_health_carries_on_as_the_original_would() -> None:
    """Same breaker transitions and command versions afterwards: a dispatcher never sees an older version."""
    original = busy_health()
    loaded = load(dump(original), policy=POLICY)
    for health in (original, loaded):
        health.observe(heartbeat("d1", NOW + 50), now_s=NOW + 50, live=True)
    for now_s in (NOW + 10, NOW + 60, NOW + 200):  # probes re-asked, a cooldown ends, a prober goes silent
        assert loaded.tick(now_s=now_s) == original.tick(now_s=now_s)
    probe = record(NOW + 201, endpoint_id="ep_c", outcome="success", probe=True)
    assert loaded.observe(probe, now_s=NOW + 201, live=True) == original.observe(
        probe, now_s=NOW + 201, live=True
    )
    assert loaded.snapshot(now_s=0) == original.snapshot(now_s=0)  # versions go on from the last one


def test_every_field_is_saved_or_deliberately_left_out() -> None:
    """A field added to the health classes must be added to the checkpoint (or to this list)."""
    document = orjson.loads(dump(busy_health()))
    endpoint, event_type = document["endpoints"]["ep_b"], document["types"]["order.paid"]
    assert set(endpoint) | {"queue_depth"} == {f.name for f in dataclasses.fields(EndpointHealth)}
    assert set(event_type) == {f.name for f in dataclasses.fields(TypeHealth)}
    assert set(endpoint["breaker"]) == {
        "state",
        "consecutive_failures",
        "opened_at_s",
        "first_opened_at_s",
        "cooldown_s",
    }


def test_queue_depths_are_not_saved() -> None:
    health = busy_health()
    health.endpoints["ep_a"].queue_depth = 12
    assert load(dump(health), policy=POLICY).endpoints["ep_a"].queue_depth is None


def test_an_empty_health_round_trips() -> None:
    loaded = load(dump(Health(POLICY)), policy=POLICY)
    assert (loaded.endpoints, loaded.types, loaded.dispatchers) == ({}, {}, {})


def _edited(change: Any) -> bytes:
    document = orjson.loads(dump(busy_health()))
    change(document)
    return orjson.dumps(document)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(_edited(lambda d: d.update(format=FORMAT_VERSION + 1)), "format 2", id="newer"),
        pytest.param(_edited(lambda d: d.pop("format")), "format None", id="no-version"),
        pytest.param(b"[1, 2]", "format None", id="not-a-document"),
        pytest.param(b"\x00garbage", "not a checkpoint", id="not-json"),
        pytest.param(
            _edited(lambda d: d["layout"]["counters"].append("new_counter")), "other statistics", id="layout"
        ),
        pytest.param(_edited(lambda d: d["endpoints"]["ep_a"].pop("day")), "damaged", id="field-missing"),
        pytest.param(
            _edited(lambda d: d["endpoints"]["ep_b"]["command"].update(state="ajar")),
            "damaged",
            id="bad-value",
        ),
    ],
)
def test_a_checkpoint_it_cannot_use_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        load(data, policy=POLICY)


async def test_the_file_reopened_gives_back_the_same_bytes_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "monitor.sqlite"
    data = dump(busy_health())
    async with CheckpointStore(path) as store:
        assert await store.read("vhost/hookline.telemetry.log") is None
        await store.save(b"older", offset=41, identity="vhost/hookline.telemetry.log")
        await store.save(data, offset=1_234_567, identity="vhost/hookline.telemetry.log")
    async with CheckpointStore(path) as store:
        assert await store.read("vhost/hookline.telemetry.log") == (data, 1_234_567)
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint")]


async def test_a_checkpoint_of_another_stream_is_ignored(tmp_path: Path) -> None:
    async with CheckpointStore(tmp_path / "monitor.sqlite") as store:
        await store.save(b"{}", offset=7, identity="vhost-a/hookline.telemetry.log")
        with capture_logs() as logs:
            assert await store.read("vhost-b/hookline.telemetry.log") is None
    assert [entry["event"] for entry in logs] == ["checkpoint_ignored"]
    assert logs[0]["stored_identity"] == "vhost-a/hookline.telemetry.log"


async def test_sqlite_stays_off_the_event_loop() -> None:
    """The connection belongs to the store's thread: used from the loop's thread, sqlite3 refuses."""
    async with CheckpointStore(None) as store:
        await store.save(b"x", offset=1, identity="i")
        with pytest.raises(sqlite3.ProgrammingError, match="thread"):
            store._opened().execute("SELECT 1")
        assert await store.read("i") == (b"x", 1)


async def test_the_store_is_used_inside_async_with_only() -> None:
    with pytest.raises(RuntimeError, match="async with"):
        await CheckpointStore(None).read("i")


#: What the monitor wrote before its sketches were dense arrays (issue 23): buckets in insertion order.
BEFORE_DENSE_SKETCHES = (
    b'{"format":1,"layout":{"counters":["attempts","successes","failures","timeouts","permanent",'
    b'"dead_letters","auth_rejected","rate_limited","max_attempt","duration_sum_ms"],'
    b'"endpoint":[[86400,3600],[3600,300],[300,60]],"type":[[86400,3600],[300,60]]},"last_version":0,'
    b'"dispatchers":[],"endpoints":{"ep_a":{'
    b'"day":[[472222,[4,3,1,0,0,0,0,0,1,516.75],[125,138,309,112],[1,1,1,1],4]],'
    b'"hour":[[5666672,[4,3,1,0,0,0,0,0,1,516.75],[125,138,309,112],[1,1,1,1],4]],'
    b'"recent":[[28333361,[4,3,1,0,0,0,0,0,1,516.75],[125,138,309,112],[1,1,1,1],4]],'
    b'"breaker":{"state":"closed","consecutive_failures":0,"opened_at_s":null,"first_opened_at_s":null,'
    b'"cooldown_s":0.0},"command":null,"retrying":{"e2":[1700001702.0,1700001702.0]},'
    b'"last_attempt_at_s":1700001703.0,"probe_asked_at_s":0.0}},"types":{"order.created":{'
    b'"day":[[472222,[4,3,1,0,0,0,0,0,1,516.75],[125,138,309,112],[1,1,1,1],4]],'
    b'"recent":[[28333361,[4,3,1,0,0,0,0,0,1,516.75],[125,138,309,112],[1,1,1,1],4]],'
    b'"last_attempt_at_s":1700001703.0}}}'
)


def test_a_checkpoint_written_before_the_dense_sketches_is_read() -> None:
    """Same format: a monitor upgraded across the change resumes from its checkpoint (no rebuild)."""
    health = load(BEFORE_DENSE_SKETCHES, policy=POLICY)
    day = health.endpoints["ep_a"].day.total(now_s=NOW)
    assert (day.attempts, day.successes, day.failures, day.sketch.count) == (4, 3, 1, 4)
    assert day.sketch.bins == {112: 1, 125: 1, 138: 1, 309: 1}
    assert day.percentile_ms(0.0) == pytest.approx(9.25, rel=0.01)
    assert day.percentile_ms(1.0) == pytest.approx(480.0, rel=0.01)
    assert health.types["order.created"].recent.total(now_s=NOW).attempts == 4
    assert (
        load(dump(health), policy=POLICY).endpoints["ep_a"].day.total(now_s=NOW).sketch.bins
        == day.sketch.bins
    )


# --- prune ----------------------------------------------------------------------------------------


def test_prune_forgets_what_no_window_breaker_or_retry_needs() -> None:
    health = Health(POLICY)
    old = NOW - 30 * HOUR  # before every window
    for endpoint_id in ("ep_quiet", "ep_open", "ep_queued"):
        health.observe(record(old, endpoint_id=endpoint_id, type="old.type"), now_s=old, live=False)
    health.restore(
        BreakerCommand(
            endpoint_id="ep_open", state=BreakerState.OPEN, version=1, opened_at_s=old, cooldown_s=60
        )
    )
    health.endpoint("ep_queued").queue_depth = 3
    health.observe(record(NOW - 60, endpoint_id="ep_live", type="new.type"), now_s=NOW - 60, live=False)
    # Out of the day window (it starts 23.5 h back) but heard of less than 24 h ago: still awaited.
    retry = record(
        NOW - 23.75 * HOUR, endpoint_id="ep_retrying", type="old.type", outcome="retry", event_id="r1"
    )
    health.observe(retry, now_s=NOW - 23.75 * HOUR, live=False)
    health.observe(heartbeat("d_gone", NOW - 2 * HOUR), now_s=NOW - 2 * HOUR, live=False)
    health.observe(heartbeat("d_here", NOW - 20), now_s=NOW - 20, live=False)

    health.prune(now_s=NOW)

    assert set(health.endpoints) == {"ep_open", "ep_queued", "ep_live", "ep_retrying"}
    assert set(health.types) == {"new.type"}
    assert set(health.dispatchers) == {"d_here"}
    health.prune(now_s=NOW + HOUR)  # now r1 has had no news for 24.75 h
    assert "ep_retrying" not in health.endpoints


def test_prune_forgets_events_awaiting_a_retry_after_a_day_without_news() -> None:
    health = Health(POLICY)
    for at_s, event_id in [(NOW - 30 * HOUR, "e1"), (NOW - 26 * HOUR, "e2"), (NOW - 25 * HOUR, "e3")]:
        failed = record(at_s, outcome="retry", event_id=event_id, first_attempt_at_s=NOW - 30 * HOUR)
        health.observe(failed, now_s=at_s, live=False)
    again = record(NOW - HOUR, outcome="retry", event_id="e1", first_attempt_at_s=NOW - 30 * HOUR)
    health.observe(again, now_s=NOW - HOUR, live=False)  # e1 is retried again: fresh news

    health.prune(now_s=NOW)

    assert health.endpoints["ep_a"].retrying == {"e1": (NOW - 30 * HOUR, NOW - HOUR)}
    assert health.endpoints["ep_a"].oldest_pending_s(NOW) == 30 * HOUR  # counted from its first attempt


def test_types_beyond_the_cap_count_together_until_a_place_frees_up() -> None:
    health = Health(dataclasses.replace(POLICY, max_types=2))
    for n, event_type in enumerate(["a.one", "b.two", "c.three", "d.four", "a.one"]):
        health.observe(record(NOW - HOUR + n, type=event_type), now_s=NOW, live=False)
    assert set(health.types) == {"a.one", "b.two", OTHER_TYPES}
    counts = {name: types.day.total(now_s=NOW).attempts for name, types in health.types.items()}
    assert counts == {"a.one": 2, "b.two": 1, OTHER_TYPES: 2}, "every record counted once"
    # A day later "a.one" and "b.two" have gone quiet: their places go to the next types.
    later = NOW + 25 * HOUR
    health.observe(record(later - 60, type="a.one"), now_s=later, live=False)
    health.prune(now_s=later)
    assert set(health.types) == {"a.one"}
    for event_type in ("c.three", "d.four", "e.five"):
        health.observe(record(later - 30, type=event_type), now_s=later, live=False)
    assert set(health.types) == {"a.one", "c.three", OTHER_TYPES}


def test_the_events_awaiting_a_retry_of_an_endpoint_are_capped_the_first_kept() -> None:
    health = Health(POLICY)
    for n in range(MAX_TRACKED_RETRIES + 10):
        failed = record(
            NOW - 600 + n * 0.01, outcome="retry", event_id=f"e{n}", first_attempt_at_s=NOW - 600 + n
        )
        health.observe(failed, now_s=NOW, live=False)
    retrying = health.endpoints["ep_a"].retrying
    assert len(retrying) == MAX_TRACKED_RETRIES
    assert "e0" in retrying
    assert f"e{MAX_TRACKED_RETRIES}" not in retrying
    assert health.endpoints["ep_a"].oldest_pending_s(NOW) == 600


# --- the alert book -------------------------------------------------------------------------------


def test_the_alert_book_comes_back_with_the_messages_still_to_send_in_order() -> None:
    firing = {
        alert.key: alert
        for alert in (
            Alert("breaker_open", "ep_a", "acme", "circuit breaker open after 3 failures"),
            Alert("broker_disk_alarm", None, None, "disk alarm on rabbit@a: every publisher is blocked"),
        )
    }
    sent_at = datetime(2026, 11, 29, 18, 0, tzinfo=UTC)
    unsent = [
        (
            aio_pika.Message(
                b'{"alert": "breaker_open"}', content_type="application/json", message_id="alert_1",
                type="breaker_open.firing",
            ),
            "alerts",
            "breaker_open.firing",
        ),
        (
            aio_pika.Message(
                b'{"type": "endpoint.failing"}', content_type="application/json", message_id="evt_1",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT, timestamp=sent_at,
            ),
            "",
            "hookline.endpoint.ep_n",
        ),
    ]  # fmt: skip
    state = load_alerts(dump_alerts(firing, unsent))
    assert state.firing == firing
    assert [(exchange, key) for _, exchange, key in state.unsent] == [(e, k) for _, e, k in unsent]
    for (got, _, _), (sent, _, _) in zip(state.unsent, unsent, strict=True):
        fields = ("body", "content_type", "message_id", "type", "delivery_mode", "timestamp")
        assert [getattr(got, f) for f in fields] == [getattr(sent, f) for f in fields]


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b'{"format": 2, "firing": [], "unsent": []}',
        b'{"format": 1, "firing": [["x"]], "unsent": []}',
    ],
)
def test_an_alert_book_it_cannot_use_is_refused(data: bytes) -> None:
    with pytest.raises(CheckpointError):
        load_alerts(data)


async def test_the_alert_book_is_kept_per_vhost_beside_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "monitor.checkpoint.sqlite"
    # A file written before the alert book existed: its checkpoint still reads, and it has no book.
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE checkpoint (id INTEGER PRIMARY KEY CHECK (id = 1), identity TEXT NOT NULL,"
            " stream_offset INTEGER NOT NULL, data BLOB NOT NULL)"
        )
        db.execute("INSERT INTO checkpoint VALUES (1, 'v/hookline.telemetry.log', 7, x'7b7d')")
    db.close()
    async with CheckpointStore(path) as store:
        assert await store.read("v/hookline.telemetry.log") == (b"{}", 7)
        assert await store.read_alerts("v/alerts") is None
        await store.save_alerts(b"book", identity="v/alerts")
    async with CheckpointStore(path) as store:
        assert await store.read_alerts("v/alerts") == b"book"
        assert await store.read_alerts("w/alerts") is None, "another vhost's book is not ours"
