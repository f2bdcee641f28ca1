"""The outbox relay as an upstream runs it: rows inserted into a real PostgreSQL in business transactions,
``hookline outbox-relay`` processes publishing them to the running system's ``events``.

What goes to ``events`` is watched through a queue of the test's own bound to it (``Tap``): every
message, in the order the broker routed them.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import httpx
import psycopg
import pytest
from support import postgres, services
from support.broker import Broker
from support.receiver import Receiver
from support.system import System, tenant
from support.waiting import eventually

from hookline.shared.broker.permissions import upstream_grant

pytestmark = pytest.mark.e2e

# Rows wait for the relay only on a NOTIFY here: a 60 s safety-net poll never fires within a test.
RELAY_ENV = {"HOOKLINE_OUTBOX_POLL_S": "60", "HOOKLINE_OUTBOX_BATCH_SIZE": "100"}


@pytest.fixture(scope="module")
def outbox_db(request: pytest.FixtureRequest) -> Iterator[str]:
    with postgres.database(request.module.__name__.rsplit(".", 1)[-1]) as url:
        # The schema as an upstream applies it: the relay's --migrate, twice (the second changes nothing).
        for expected in ("applied: 0001_outbox.sql", "already up to date"):
            done = subprocess.run(
                [services.HOOKLINE, "outbox-relay", "--dsn", url, "--migrate"],
                capture_output=True, text=True, timeout=60, check=False,
                env={k: v for k, v in services.base_env("amqp://unused/").items()},
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            assert expected in done.stdout, done.stdout
        yield url


@dataclass
class Relays:
    system: System
    dsn: str
    running: list[services.Service] = field(default_factory=list)

    def start(self, name: str, **env: str) -> services.Service:
        relay = services.start(
            "outbox-relay",
            {**self.system.env, "HOOKLINE_OUTBOX_DSN": self.dsn, **RELAY_ENV, **env},
            self.system.log_dir,
            name=f"{name}-{uuid.uuid4().hex[:4]}",
        )
        relay.wait_ready()
        self.running.append(relay)
        return relay


@pytest.fixture
def relays(system: System, outbox_db: str) -> Iterator[Relays]:
    started = Relays(system, outbox_db)
    yield started
    codes = {relay.name: relay.stop() for relay in started.running if not relay.killed}
    assert set(codes.values()) <= {0}, f"exit codes {codes}\n" + "\n".join(r.log() for r in started.running)


@dataclass
class Tap:
    """Every message routed to ``events`` from the moment it is bound (a queue of the test's own)."""

    messages: list[aio_pika.abc.AbstractIncomingMessage] = field(default_factory=list)

    def ids(self) -> Counter[str]:
        return Counter(m.message_id or "" for m in self.messages)

    def events(self, tenant_: str) -> list[dict[str, Any]]:
        return [json.loads(m.body) for m in self.messages if (m.routing_key or "").startswith(f"{tenant_}.")]


@asynccontextmanager
async def tap(amqp_url: str) -> AsyncIterator[Tap]:
    tapped = Tap()
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=1000)
        queue = await channel.declare_queue(f"test-tap-{uuid.uuid4().hex[:8]}", exclusive=True)
        await queue.bind("events", routing_key="#")

        async def collect(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            tapped.messages.append(message)
            await message.ack()

        await queue.consume(collect)
        yield tapped


def insert(dsn: str, rows: list[dict[str, Any]]) -> list[tuple[int, str, int | None]]:
    """Rows inserted in one business transaction; their (position, id, sequence)."""
    with psycopg.connect(dsn) as conn:
        return [
            conn.execute(
                "INSERT INTO hookline_outbox (tenant, type, subject, numbered, data) VALUES (%s, %s, %s, %s, %s) "
                "RETURNING position, id, sequence",
                (
                    row["tenant"],
                    row["type"],
                    row.get("subject"),
                    row.get("numbered", False),
                    json.dumps(row["data"]),
                ),
            ).fetchone()  # type: ignore[misc]
            for row in rows
        ]


def query(dsn: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql, params).fetchall()  # type: ignore[arg-type]


def unsent(dsn: str, tenant_: str) -> int:
    [(count,)] = query(
        dsn, "SELECT count(*) FROM hookline_outbox WHERE tenant = %s AND sent_at IS NULL", tenant_
    )
    return int(count)


async def all_sent(dsn: str, tenant_: str) -> None:
    await eventually(
        lambda: asyncio.to_thread(lambda: unsent(dsn, tenant_) == 0),
        explain=lambda: f"{unsent(dsn, tenant_)} rows of {tenant_} not marked sent",
    )


def metric(relay: services.Service, name: str) -> float:
    text = httpx.get(f"{relay.base_url}/metrics", timeout=5).text
    found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert found, f"{name} not exported"
    return float(found[1])


async def test_numbered_rows_reach_an_ordered_endpoint_in_order_with_their_sequence(
    system: System, relays: Relays, receiver: Receiver
) -> None:
    """One INSERT per event in the business transaction: the relay (woken by NOTIFY, its poll being a
    minute) publishes them; the endpoint receives each subject's events in order, numbered 1, 2, 3."""
    acme = tenant()
    system.add_endpoint(acme, receiver.url("/ordered"), ["order.*"], ordered=True)
    relays.start("relay")
    rows = [
        {"tenant": acme, "type": "order.created", "subject": subject, "numbered": True, "data": {"n": n}}
        for n in range(3)
        for subject in ("order_1", "order_2")
    ]
    inserted = insert(relays.dsn, rows)
    assert [sequence for _, _, sequence in inserted] == [1, 1, 2, 2, 3, 3]
    delivered = await receiver.wait_for(6, path="/ordered", timeout_s=30)
    by_subject: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for request in delivered:
        body = json.loads(request.body)
        by_subject[body["subject"]].append((request.headers["webhook-sequence"], body["data"]["n"]))
    assert by_subject == {s: [("1", 0), ("2", 1), ("3", 2)] for s in ("order_1", "order_2")}
    assert {r.headers["webhook-id"] for r in delivered} == {event_id for _, event_id, _ in inserted}
    await all_sent(relays.dsn, acme)


async def test_a_relay_killed_after_publishing_before_marking_sent_sends_again_and_loses_nothing(
    system: System, relays: Relays
) -> None:
    """The relay is stopped dead between the broker's confirms and its commit: a test transaction holds
    the table in SHARE mode, which lets the relay claim rows (ROW SHARE) but not mark them sent (ROW
    EXCLUSIVE). Killed there, its transaction rolls back, and the next relay publishes every row again:
    duplicates, never a loss."""
    acme = tenant()
    inserted = insert(relays.dsn, [{"tenant": acme, "type": "a.b", "data": {"n": n}} for n in range(50)])
    ids = {event_id for _, event_id, _ in inserted}
    async with tap(system.amqp_url) as tapped:
        with psycopg.connect(relays.dsn) as blocker:
            blocker.execute("LOCK TABLE hookline_outbox IN SHARE MODE")
            first = relays.start("relay-killed")
            await eventually(
                lambda: asyncio.sleep(0, set(tapped.ids()) >= ids),
                timeout_s=30,
                explain=lambda: f"published {len(set(tapped.ids()) & ids)} of 50\n{first.log()[-2000:]}",
            )
            first.kill()
            blocker.rollback()
        assert unsent(relays.dsn, acme) == 50, "the kill came after the commit: nothing was tested"
        relays.start("relay-after")
        await eventually(
            lambda: asyncio.sleep(0, all(tapped.ids()[i] >= 2 for i in ids)),
            timeout_s=30,
            explain=lambda: f"ids seen twice: {sum(tapped.ids()[i] >= 2 for i in ids)} of 50",
        )
    await all_sent(relays.dsn, acme)


async def test_two_relays_share_the_rows_publish_each_once_and_keep_every_subject_in_order(
    system: System, relays: Relays
) -> None:
    """2,000 numbered rows over 40 subjects, inserted in 100 transactions while two relays with small
    batches run: each row is published exactly once, and each subject's rows reach the broker in
    sequence order (a row waits while an earlier one of its subject is in the other relay's batch)."""
    acme = tenant()
    relays.start("relay-a", HOOKLINE_OUTBOX_BATCH_SIZE="37")
    relays.start("relay-b", HOOKLINE_OUTBOX_BATCH_SIZE="23")
    async with tap(system.amqp_url) as tapped:
        inserted: list[tuple[int, str, int | None]] = []
        for chunk in range(100):
            rows = [
                {
                    "tenant": acme,
                    "type": "a.b",
                    "subject": f"s{(chunk * 20 + n) % 40}",
                    "numbered": True,
                    "data": {},
                }
                for n in range(20)
            ]
            inserted += await asyncio.to_thread(insert, relays.dsn, rows)
        ids = {event_id for _, event_id, _ in inserted}
        sentinel = (
            await asyncio.to_thread(insert, relays.dsn, [{"tenant": acme, "type": "a.end", "data": {}}])
        )[0][1]
        await eventually(
            lambda: asyncio.sleep(0, set(tapped.ids()) >= ids | {sentinel}),
            timeout_s=60,
            explain=lambda: f"published {len(set(tapped.ids()) & ids)} of {len(ids)}",
        )
    published = [e for e in tapped.events(acme) if e["id"] in ids]
    assert len(published) == len(ids), f"{len(published) - len(ids)} rows published twice"
    sequences: dict[str, list[int]] = defaultdict(list)
    for event in published:
        sequences[event["subject"]].append(event["sequence"])
    assert {subject: seq == sorted(seq) for subject, seq in sequences.items()} == dict.fromkeys(
        sequences, True
    )
    assert sum(len(seq) for seq in sequences.values()) == 2000


async def test_a_row_that_makes_no_event_keeps_its_error_and_holds_nothing_back(
    system: System, relays: Relays
) -> None:
    """A row over the payload limit is not published: its error column says why, the failed-rows gauge
    counts it, and the rows after it (its subject's too) go on."""
    acme = tenant()
    relay = relays.start("relay-limits", HOOKLINE_MAX_PAYLOAD_BYTES="2048")
    async with tap(system.amqp_url) as tapped:
        [(_, too_big, _), (_, after, _)] = insert(relays.dsn, [
            {"tenant": acme, "type": "a.b", "subject": "s", "numbered": True, "data": {"x": "y" * 3000}},
            {"tenant": acme, "type": "a.b", "subject": "s", "numbered": True, "data": {}},
        ])  # fmt: skip
        await eventually(lambda: asyncio.sleep(0, after in tapped.ids()), timeout_s=30)
    assert too_big not in tapped.ids()
    [(error, sent_at)] = query(
        relays.dsn, "SELECT error, sent_at FROM hookline_outbox WHERE id = %s", too_big
    )
    assert sent_at is None
    assert "over HOOKLINE_MAX_PAYLOAD_BYTES (2048)" in error
    await eventually(
        lambda: asyncio.to_thread(lambda: metric(relay, "hookline_outbox_failed_rows") >= 1), timeout_s=30
    )
    assert '"event":"outbox_row_refused"' in relay.log()
    assert "yyyy" not in relay.log()


async def test_the_lag_is_exported_and_alerted_and_the_relay_outlives_its_connections(
    system: System, relays: Relays
) -> None:
    """A row another transaction holds (locked) is skipped, not waited for: its age shows in
    hookline_outbox_lag_seconds and, past HOOKLINE_OUTBOX_LAG_ALERT_S, as an outbox_lagging alert. The
    relay's database connections are then cut (pg_terminate_backend): it reconnects and publishes on.
    With a retention of 0, rows are deleted once confirmed."""
    acme = tenant()
    [(_, held, _)] = insert(relays.dsn, [{"tenant": acme, "type": "a.b", "data": {}}])
    async with tap(system.amqp_url) as tapped:
        with psycopg.connect(relays.dsn) as holder:
            holder.execute("SELECT 1 FROM hookline_outbox WHERE id = %s FOR UPDATE", (held,))
            relay = relays.start(
                "relay-lag", HOOKLINE_OUTBOX_LAG_ALERT_S="1", HOOKLINE_OUTBOX_RETENTION_S="0"
            )
            [(_, passing, _)] = insert(relays.dsn, [{"tenant": acme, "type": "a.b", "data": {}}])
            await eventually(lambda: asyncio.sleep(0, passing in tapped.ids()), timeout_s=30)
            await eventually(
                lambda: asyncio.to_thread(lambda: '"event":"outbox_lagging"' in relay.log()),
                timeout_s=30,
                explain=lambda: relay.log()[-2000:],
            )
            assert metric(relay, "hookline_outbox_lag_seconds") > 1
            holder.rollback()
        await eventually(lambda: asyncio.sleep(0, held in tapped.ids()), timeout_s=30)
        await eventually(
            lambda: asyncio.to_thread(lambda: '"event":"outbox_caught_up"' in relay.log()), timeout_s=30
        )

        cut = query(
            relays.dsn,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'hookline-outbox-relay'",
        )
        assert len(cut) >= 3  # its relay, listen and watch connections
        [(_, after_cut, _)] = insert(relays.dsn, [{"tenant": acme, "type": "a.b", "data": {}}])
        await eventually(lambda: asyncio.sleep(0, after_cut in tapped.ids()), timeout_s=60, explain=relay.log)
    assert '"event":"loop_restarting"' in relay.log()
    remaining = query(relays.dsn, "SELECT count(*) FROM hookline_outbox WHERE tenant = %s", acme)
    assert remaining == [(0,)], "retention 0: rows deleted once confirmed"
    ready = await asyncio.to_thread(httpx.get, f"{relay.base_url}/readyz", timeout=5)
    assert ready.status_code == 200


async def test_a_relay_needs_no_more_than_an_upstreams_broker_user(
    system: System, relays: Relays, rabbitmq: Broker
) -> None:
    """Write on events and nothing else (permissions.upstream_grant): the relay publishes, is ready and
    stops cleanly as that user, with no refusal logged."""
    grant, _ = upstream_grant(None)
    user, password = f"outbox-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    vhost = unquote(urlsplit(system.amqp_url).path.lstrip("/"))
    await rabbitmq.ctl_async(["add_user", user, password])
    try:
        await rabbitmq.ctl_async(
            ["set_permissions", "-p", vhost, user, grant.configure, grant.write, grant.read]
        )
        url = system.amqp_url.replace("guest:guest@", f"{user}:{password}@")
        relay = relays.start("relay-upstream-user", HOOKLINE_AMQP_URL=url)
        acme = tenant()
        insert(relays.dsn, [{"tenant": acme, "type": "a.b", "data": {}}])
        await all_sent(relays.dsn, acme)
        assert relay.stop() == 0
        assert "ACCESS_REFUSED" not in relay.log()
    finally:
        await rabbitmq.ctl_async(["delete_user", user])


def test_a_relay_without_the_outbox_table_stops_and_says_how_to_create_it(system: System) -> None:
    with postgres.database("outbox_empty") as empty:
        done = subprocess.run(
            [services.HOOKLINE, "outbox-relay", "--dsn", empty],
            capture_output=True, text=True, timeout=60, check=False,
            env={**system.env, "HOOKLINE_OUTBOX_METRICS_PORT": "0"},
        )  # fmt: skip
    assert done.returncode == 2
    assert "outbox_schema_missing" in done.stdout
    assert "--migrate" in done.stdout


@pytest.mark.serial
async def test_the_relay_publishes_on_after_a_broker_restart(
    system: System, relays: Relays, rabbitmq: Broker, receiver: Receiver
) -> None:
    acme = tenant()
    system.add_endpoint(acme, receiver.url("/restart"), ["a.*"])
    relay = relays.start("relay-restart")
    [(_, before, _)] = insert(relays.dsn, [{"tenant": acme, "type": "a.b", "data": {}}])
    await receiver.wait_for_ids({before}, path="/restart", timeout_s=30)
    await rabbitmq.restart_app()
    [(_, after, _)] = insert(relays.dsn, [{"tenant": acme, "type": "a.b", "data": {}}])
    await receiver.wait_for_ids({before, after}, path="/restart", timeout_s=90)
    await eventually(
        lambda: asyncio.to_thread(
            lambda: httpx.get(f"{relay.base_url}/readyz", timeout=5).status_code == 200
        ),
        timeout_s=60,
        explain=relay.log,
    )
