"""Operating a deployment across what happens to it (each test starts the services it needs).

Least privilege on the broker: `hookline broker-setup` users, each service running as its own, and
upstreams that can publish their own tenant's events and nothing else. (from test_broker_permissions.py)

Backing up the change log and restoring it into a broker that lost everything, with the real services.

A system with endpoints (one with a rotated secret, one paused, one with a notify_url, hence a
notifier), an event type, a tenant token and a quota is exported with ``hookline export``; its vhost is
deleted and created again, empty; ``hookline import`` restores it (twice: the second changes nothing),
and the services started on it deliver to every restored endpoint, signed with the secrets it had.

And (from test_upgrade.py): an endpoint registered by a version before lanes keeps working after an
upgrade.

Its queue was bound to ``events`` directly (two versions back; the version before added route exchanges
in between) and its retries were addressed to the queue. The ingest moves it onto its tenant's lane at
start (once, conditionally): the lane bound first, then its record, then its old bindings removed; its
old queue is drained into its lane. Nothing queued before is lost, and its retries still come back.
(An event published in the moment between its record and the removal of its old bindings reaches it
twice: at least once; the test publishes after the move.)
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import aiormq
import httpx
import pytest
from standardwebhooks.webhooks import Webhook
from support import broker as test_broker
from support import services
from support.amqp import event, publish_event, queue_exists
from support.broker import Broker
from support.receiver import Received, Receiver, Reply
from support.system import System, services_running, tenant
from support.waiting import eventually

from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker as AmqpBroker
from hookline.shared.broker.permissions import USERS, Role
from hookline.shared.broker.topology import Retention
from hookline.shared.contracts import ids
from hookline.shared.contracts.models import (
    EndpointUpserted,
    SigningSecret,
    StoredEndpoint,
    StoredToken,
    TokenUpserted,
)
from hookline.shared.outbound.signing import generate_secret
from hookline.shared.state import tenants

pytestmark = pytest.mark.e2e

SETTINGS = {"HOOKLINE_SECRET_KEY": "a-long-random-secret-key-for-the-backup-test-0123"}
ADMIN = {"authorization": f"Bearer {services.TOKEN}"}
ORDER_SCHEMA = {"type": "object", "required": ["total"], "properties": {"total": {"type": "integer"}}}


def hookline(env: dict[str, str], *arguments: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([services.HOOKLINE, *arguments], env=env, capture_output=True, timeout=120)


async def call(
    system: System, method: str, path: str, token: str = services.TOKEN, **kw: Any
) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=system.ingest.base_url, headers=headers, timeout=30) as client:
        return await client.request(method, path, **kw)


async def ok(system: System, method: str, path: str, **kw: Any) -> Any:
    response = await call(system, method, path, **kw)
    assert response.status_code in (200, 201), f"{method} {path}: {response.status_code} {response.text}"
    return response.json()


async def build(system: System, receiver: Receiver, acme: str) -> dict[str, Any]:
    """Endpoints, a type, a token and a quota; what the test needs to know of them afterwards."""
    made: dict[str, Any] = {}
    for name, extra in (("plain", {"notify_url": receiver.url("/notify")}), ("rotated", {}), ("paused", {})):
        body = {"tenant": acme, "url": receiver.url(f"/{name}"), "event_types": ["order.*"], "verify": False}
        made[name] = await ok(system, "POST", "/v1/endpoints", json=body | extra)
    made["old_secret"] = made["rotated"]["secret"]
    rotated = await ok(system, "POST", f"/v1/endpoints/{made['rotated']['id']}/rotate-secret", json={})
    made["new_secret"] = rotated["secret"]
    await ok(system, "POST", f"/v1/endpoints/{made['paused']['id']}/pause")
    await ok(
        system, "POST", "/v1/event-types",
        json={"name": "order.created", "schemas": {"1": ORDER_SCHEMA}, "validation": "enforce"},
    )  # fmt: skip
    made["token"] = (await ok(system, "POST", "/v1/tokens", json={"tenant": acme}))["token"]
    made["quota"] = {"max_endpoints": 10, "events_per_s": 100.0, "burst": None, "bytes_per_day": None}
    await ok(system, "PUT", f"/v1/tenants/{acme}/quota", json=made["quota"])
    return made


def verified(request: Received, secret: str) -> bool:
    Webhook(secret).verify(request.body, request.headers)  # raises when it does not
    return True


async def test_a_backup_restores_a_working_system_into_a_broker_that_lost_everything(
    rabbitmq: Broker, receiver: Receiver, tmp_path: Path
) -> None:
    acme = tenant()
    backup_file = tmp_path / "backup.jsonl"
    with rabbitmq.vhost() as amqp_url:
        env = services.base_env(amqp_url, **SETTINGS)
        with services_running(amqp_url, tmp_path / "before", SETTINGS) as before:
            made = await build(before, receiver, acme)
            exported = await asyncio.to_thread(hookline, env, "export")
        assert exported.returncode == 0, exported.stderr.decode()
        backup_file.write_bytes(exported.stdout)
        header, *lines = [json.loads(line) for line in exported.stdout.splitlines()]
        assert (header["format"], header["version"]) == ("hookline-backup", 1)
        assert header["counts"] == {"endpoints": 4, "event_types": 1, "tokens": 1, "quotas": 1}  # + notifier
        assert [line["kind"] for line in lines] == ["endpoint"] * 4 + ["event_type", "token", "quota"]
        assert isinstance(header["offset"], int)
        for secret in (made["old_secret"], made["new_secret"], made["token"]):
            assert secret.encode() not in exported.stdout, "secrets stay sealed, tokens digested"

        rabbitmq.recreate_vhost(amqp_url)
        wrong_key = {**env, "HOOKLINE_SECRET_KEY": "not-the-key-the-secrets-were-sealed-with"}
        refused = await asyncio.to_thread(hookline, wrong_key, "import", str(backup_file))
        assert refused.returncode == 1
        assert "is not the key this secret was sealed with" in refused.stderr.decode()
        restored = await asyncio.to_thread(hookline, env, "import", str(backup_file))
        assert restored.returncode == 0, restored.stderr.decode()
        assert json.loads(restored.stdout)["written"] == header["counts"], "all of it: nothing before"
        again = await asyncio.to_thread(hookline, env, "import", str(backup_file))
        assert again.returncode == 0, again.stderr.decode()
        assert (json.loads(again.stdout)["written"], json.loads(again.stdout)["already_there"]) == (
            {"endpoints": 0, "event_types": 0, "tokens": 0, "quotas": 0},
            7,
        )

        with services_running(amqp_url, tmp_path / "after", SETTINGS) as after:
            await check_restored(after, receiver, acme, made)
            # The log now holds more than the backup: a second import is refused, naming why.
            extra = {"tenant": acme, "url": receiver.url("/new"), "event_types": ["x.y"], "verify": False}
            new = await ok(after, "POST", "/v1/endpoints", json=extra)
            refused = await asyncio.to_thread(hookline, env, "import", str(backup_file))
            assert refused.returncode == 1
            assert f"endpoint {new['id']} is not in the backup" in refused.stderr.decode()


async def check_restored(system: System, receiver: Receiver, acme: str, made: dict[str, Any]) -> None:
    plain, rotated, paused = made["plain"], made["rotated"], made["paused"]
    # The tenant token works, and sees its tenant's endpoints as they were.
    listed = await call(system, "GET", "/v1/endpoints", token=made["token"])
    assert listed.status_code == 200, listed.text
    shown = {e["id"]: e for e in listed.json()["data"]}
    assert set(shown) == {plain["id"], rotated["id"], paused["id"]}
    assert shown[paused["id"]]["status"] == "paused"
    assert shown[plain["id"]]["notify_url"] == receiver.url("/notify")
    secret = await ok(system, "GET", f"/v1/endpoints/{rotated['id']}/secret")
    assert secret["secret"] == made["new_secret"]
    assert (await ok(system, "GET", f"/v1/tenants/{acme}/quota"))["quota"] == made["quota"]
    # The catalog enforces its schema again.
    invalid = await call(system, "POST", "/v1/events", token=made["token"],
                         json={"tenant": acme, "type": "order.created", "data": {"total": "many"}})  # fmt: skip
    assert invalid.status_code == 422, invalid.text

    published = await call(system, "POST", "/v1/events", token=made["token"],
                           json={"tenant": acme, "type": "order.created", "data": {"total": 42}})  # fmt: skip
    assert published.status_code == 202, published.text
    event_id = published.json()["id"]

    def arrived(path: str) -> Received | None:
        return next(
            (r for r in receiver.requests if r.path == path and r.headers["webhook-id"] == event_id), None
        )

    async def both() -> tuple[Received, Received] | None:
        found = arrived("/plain"), arrived("/rotated")
        return (found[0], found[1]) if found[0] and found[1] else None

    at_plain, at_rotated = await eventually(both, timeout_s=30)
    assert verified(at_plain, plain["secret"])
    assert verified(at_rotated, made["old_secret"]), "the secret it had before the rotation still signs"
    assert verified(at_rotated, made["new_secret"])
    # The paused endpoint stayed paused: the event waits in its queue, and comes once it is resumed.
    assert arrived("/paused") is None
    await ok(system, "POST", f"/v1/endpoints/{paused['id']}/resume")

    async def at_paused() -> Received | None:
        return arrived("/paused")

    assert verified(await eventually(at_paused, timeout_s=30), paused["secret"])


async def _register_the_old_way(amqp_url: str, endpoint: StoredEndpoint) -> None:
    """What the previous version's ingest did: a queue bound to ``events`` and to the delay exchange by
    its own name, and an unconditional record without the new fields."""
    async with AmqpBroker(amqp_url, name="old-ingest", connect_timeout_s=10) as broker:
        await topology.declare(broker, topology.Retention())
        async with broker.channel(confirms=True) as channel:
            queue = await channel.declare_queue(
                topology.endpoint_queue(endpoint.id),
                durable=True,
                arguments=topology.endpoint_queue_arguments(single_consumer=False),
            )
            for key in topology.binding_keys(endpoint.tenant, endpoint.event_types):
                await queue.bind(topology.EVENTS_EXCHANGE, routing_key=key)
            await queue.bind(topology.DELAY_DELIVERY, routing_key=topology.delay_delivery_binding(queue.name))
            record = EndpointUpserted(
                change_id=f"chg_{uuid.uuid4().hex}", at=endpoint.created_at, endpoint=endpoint
            )
            body = record.model_dump_json(
                exclude={
                    "base_version": True,
                    "endpoint": {"queue_generation", "retired_queues", "routed", "laned", "version"},
                }
            )
            await channel.default_exchange.publish(
                aio_pika.Message(body.encode(), content_type="application/json", message_id=record.change_id),
                routing_key=topology.ENDPOINT_LOG,
            )


async def _arrived(receiver: Receiver, event_id: str) -> bool:
    return any(r.headers.get("webhook-id") == event_id for r in receiver.requests)


@pytest.fixture
async def legacy(rabbitmq: test_broker.Broker, tmp_path: Path) -> AsyncIterator[tuple[str, dict[str, str]]]:
    with rabbitmq.vhost() as amqp_url:
        env = services.base_env(amqp_url, HOOKLINE_STATE_DIR=str(tmp_path / "state"))
        yield amqp_url, env


async def test_an_endpoint_of_the_previous_version_is_upgraded_without_loss(
    legacy: tuple[str, dict[str, str]], receiver: Receiver, tmp_path: Path
) -> None:
    amqp_url, env = legacy
    tenant = f"t{uuid.uuid4().hex[:10]}"
    now = datetime.now(UTC)
    endpoint = StoredEndpoint(
        id=f"ep_01OLD{uuid.uuid4().hex[:21].upper()}",
        tenant=tenant,
        url=receiver.url("/old"),
        event_types=["#"],
        created_at=now,
        updated_at=now,
        secrets=[SigningSecret(value=generate_secret(), created_at=now)],
    )
    await _register_the_old_way(amqp_url, endpoint)
    seen: set[str] = set()

    def respond(request: Received) -> Reply:
        event_id = request.headers["webhook-id"]
        if event_id == "evt_old_retried" and event_id not in seen:
            seen.add(event_id)
            return Reply(status=500)  # its retry must find its way back after the upgrade
        return Reply(status=204)

    receiver.responder = respond
    before = [f"evt_old_before_{n}" for n in range(5)]
    for event_id in before:  # queued while nothing runs
        await publish_event(amqp_url, event(tenant, "a.b", event_id), f"{tenant}.a.b")

    running = [services.start(name, env, tmp_path) for name in ("ingest", "dispatcher")]
    try:
        for service in running:
            service.wait_ready()
        ingest = running[0]

        queue = topology.endpoint_queue(endpoint.id)
        lane = topology.lane_of(tenant)

        async def upgraded() -> dict[str, Any] | None:
            async with httpx.AsyncClient(
                base_url=ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}
            ) as api:
                shown = (await api.get(f"/v1/endpoints/{endpoint.id}")).json()
            if shown.get("version", 0) < 2:
                return None
            pairs = await bindings(amqp_url)
            return shown if ("events", queue) not in pairs and ("events", lane) in pairs else None

        await eventually(upgraded, timeout_s=30)
        after = ["evt_old_retried", *(f"evt_old_after_{n}" for n in range(5))]
        for event_id in after:
            await publish_event(amqp_url, event(tenant, "a.b", event_id), f"{tenant}.a.b")
        await receiver.wait_for(len(before) + len(after) + 1, path="/old", timeout_s=30)
        # A sentinel published last: once it is in, a duplicate of anything before would be too.
        await publish_event(amqp_url, event(tenant, "a.b", "evt_old_sentinel"), f"{tenant}.a.b")
        await eventually(lambda: _arrived(receiver, "evt_old_sentinel"), timeout_s=30)
        delivered = Counter(r.headers["webhook-id"] for r in receiver.requests if r.path == "/old")
        # Every event once (the retried one twice: its failed attempt and its retry), none lost.
        assert delivered == {**dict.fromkeys([*before, *after, "evt_old_sentinel"], 1), "evt_old_retried": 2}
        # Its lane feeds it now: no binding of its own is left, and no route exchange was made for it.
        pairs = await bindings(amqp_url)
        left = [
            pair
            for pair in pairs
            if (queue in pair and pair[0] != "") or topology.route_exchange(endpoint.id) in pair[0]
        ]
        assert not left, "only the default exchange's implicit binding to its old queue is left"
        assert ("events", lane) in pairs
    finally:
        codes = [service.stop() for service in running]
    assert codes == [0, 0]


async def bindings(amqp_url: str) -> set[tuple[str, ...]]:
    listed = await asyncio.to_thread(
        subprocess.run,
        ["rabbitmqctl", "-q", "list_bindings", "-p", amqp_url.rsplit("/", 1)[1], "source_name", "destination_name"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return {tuple(line.split("\t")) for line in listed.stdout.splitlines()}


async def test_an_ordered_endpoint_on_its_lane_leaves_it_at_start(
    legacy: tuple[str, dict[str, str]], receiver: Receiver, tmp_path: Path
) -> None:
    """An ordered endpoint of the version before straight endpoints: a queue of its own its lane copies
    were handed on to. At start the ingest binds that queue to ``events``, writes it leaving its lane and
    sends the fence; the dispatcher that takes it writes it off its lane. Events of one subject then
    reach it, each once, in the order published."""
    amqp_url, env = legacy
    tenant = f"t{uuid.uuid4().hex[:10]}"
    now = datetime.now(UTC)
    endpoint = StoredEndpoint(
        id=f"ep_01ORD{uuid.uuid4().hex[:21].upper()}", tenant=tenant, url=receiver.url("/ordered"),
        event_types=["o.*"], created_at=now, updated_at=now, ordered=True, routed=True, laned=True,
        secrets=[SigningSecret(value=generate_secret(), created_at=now)],
    )  # fmt: skip
    async with AmqpBroker(amqp_url, name="old-ingest", connect_timeout_s=10) as broker:
        await topology.declare(broker, topology.Retention())
        async with broker.channel(confirms=True) as channel:
            await topology.provision(channel, endpoint, isolated=True)
            record = EndpointUpserted(change_id=f"chg_{uuid.uuid4().hex}", at=now, endpoint=endpoint)
            body = record.model_dump_json(
                exclude={"endpoint": {"straight", "lane_fence", "left_lane_at"}}
            )  # as the version before wrote it
            await channel.default_exchange.publish(
                aio_pika.Message(body.encode(), content_type="application/json", message_id=record.change_id),
                routing_key=topology.ENDPOINT_LOG,
            )
    running = [services.start(name, env, tmp_path) for name in ("ingest", "dispatcher")]
    try:
        for service in running:
            service.wait_ready()
        ingest, dispatcher = running

        async def left_its_lane() -> bool:
            return any(
                r.get("event") == "endpoint_fence_passed" and r.get("verdict") == "left"
                for r in _records(dispatcher)
            )

        await eventually(left_its_lane, timeout_s=30)
        assert ("events", topology.own_queue(endpoint)) in await bindings(amqp_url)
        assert [r.get("to") for r in _records(ingest) if r.get("event") == "endpoint_upgraded"] == [
            "straight"
        ]
        ids = [f"evt_ordered_{n}" for n in range(20)]
        for event_id in ids:
            await publish_event(amqp_url, {**event(tenant, "o.x", event_id), "subject": "s"}, f"{tenant}.o.x")
        await receiver.wait_for_ids(set(ids), path="/ordered", timeout_s=60)

        # Its lane is still bound for them (no monitor here to unbind it), and it left a moment ago:
        # each event's lane copy is handed on too, a while later, and skipped as a second copy.
        async def second_copies_skipped() -> bool:
            skipped = {
                r.get("event_id")
                for r in _records(dispatcher)
                if r.get("event") == "redelivery_already_settled"
            }
            return skipped >= set(ids)

        await eventually(second_copies_skipped, timeout_s=60)
        assert [r.headers["webhook-id"] for r in receiver.requests if r.path == "/ordered"] == ids

        # Answered slowly, each straight copy is still being attempted when its second copy comes (5 s
        # on): that one is skipped too, not put behind it in its subject and sent once more.
        receiver.responder = lambda _: Reply(delay_s=8)
        slow = [f"evt_slow_{n}" for n in range(3)]
        for n, event_id in enumerate(slow):
            await publish_event(
                amqp_url, {**event(tenant, "o.x", event_id), "subject": f"s{n}"}, f"{tenant}.o.x"
            )

        async def slow_second_copies_skipped() -> bool:
            skipped = {
                r.get("event_id")
                for r in _records(dispatcher)
                if r.get("event") == "redelivery_already_settled" and r.get("outcome") == "taken_straight"
            }
            return skipped >= set(slow)

        await eventually(slow_second_copies_skipped, timeout_s=60)
        await receiver.wait_for_ids(set(slow), path="/ordered", timeout_s=60)
        sent = Counter(r.headers["webhook-id"] for r in receiver.requests if r.path == "/ordered")
        assert {event_id: sent[event_id] for event_id in slow} == dict.fromkeys(slow, 1)
    finally:
        codes = [service.stop() for service in running]
    assert codes == [0, 0]


def _records(service: services.Service) -> list[dict[str, Any]]:
    return [json.loads(line) for line in service.log().splitlines() if line.startswith("{")]


ROLE_PASSWORD = "role-password-for-the-tests-0123"
SERVICE_ENV = {
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "3",
    "HOOKLINE_BREAKER_COOLDOWN_S": "2",
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_QUEUE_POLL_S": "0.5",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    "HOOKLINE_RETIRED_QUEUE_GRACE_S": "1",
}


@dataclass
class Setup:
    vhost_url: str  # as the admin (the tests' own user)
    urls: dict[str, str]  # user -> URL with its credentials
    acme: str
    acme_upstream: str
    any_upstream: str
    output: dict[str, Any]


def _broker_setup(vhost_url: str, *arguments: str) -> dict[str, Any]:
    env = services.base_env(vhost_url)
    env.update({f"HOOKLINE_BROKER_PASSWORD_HOOKLINE_{role.upper()}": ROLE_PASSWORD for role in Role})
    done = subprocess.run(
        [services.HOOKLINE, "broker-setup", *arguments], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    output: dict[str, Any] = json.loads(done.stdout)
    return output


@pytest.fixture(scope="module")
def setup(rabbitmq: Broker) -> Iterator[Setup]:
    acme = tenant()
    suffix = uuid.uuid4().hex[:8]
    acme_upstream, any_upstream = f"upstream-{acme}", f"upstream-all-{suffix}"
    with rabbitmq.vhost() as vhost_url:
        output = _broker_setup(vhost_url, "--upstream", f"{acme_upstream}:{acme}", "--upstream", any_upstream)
        users = {user["user"]: user for user in output["users"]}
        urls = {u: users[u]["amqp_url"] for u in (acme_upstream, any_upstream)}
        for role in Role:
            urls[USERS[role]] = vhost_url.replace("guest:guest@", f"{USERS[role]}:{ROLE_PASSWORD}@")
        try:
            yield Setup(vhost_url, urls, acme, acme_upstream, any_upstream, output)
        finally:
            # The role users too: their password is in this file, so none is left on a broker.
            for user in (acme_upstream, any_upstream, *USERS.values()):
                rabbitmq.ctl(["delete_user", user])


def test_setup_prints_each_new_password_once_and_never_one_it_was_given(
    setup: Setup, rabbitmq: Broker
) -> None:
    users = {user["user"]: user for user in setup.output["users"]}
    assert {users[USERS[role]]["role"] for role in Role} == {"ingest", "dispatcher", "monitor"}
    for role in Role:
        assert users[USERS[role]]["password"] is None
        assert users[USERS[role]]["amqp_url"] is None
    upstream = users[setup.acme_upstream]
    assert upstream["role"] == "upstream"
    assert upstream["tenant"] == setup.acme
    assert len(upstream["password"]) >= 32
    assert upstream["password"] in upstream["amqp_url"]
    # Run again: permissions set again, a password kept (not printed) unless asked to rotate.
    again = _broker_setup(setup.vhost_url, "--upstream", f"{setup.acme_upstream}:{setup.acme}")
    kept = {user["user"]: user for user in again["users"]}[setup.acme_upstream]
    assert kept["password"] is None
    assert kept["amqp_url"] is None
    listed = rabbitmq.ctl(["list_topic_permissions", "-p", setup.vhost_url.rsplit("/", 1)[1]])
    assert f"{setup.acme_upstream}\tevents\t^{setup.acme}\\." in listed


async def _refused(url: str, operation: Callable[[aio_pika.abc.AbstractChannel], Awaitable[object]]) -> bool:
    """Whether the broker refuses ``operation`` for this user (ACCESS_REFUSED); False when it is done."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        try:
            await operation(channel)
        except aiormq.exceptions.ChannelAccessRefused:
            return True
    return False


def _publish(exchange: str, routing_key: str) -> Callable[[aio_pika.abc.AbstractChannel], Awaitable[object]]:
    async def run(channel: aio_pika.abc.AbstractChannel) -> object:
        target = (
            channel.default_exchange if exchange == "" else await channel.get_exchange(exchange, ensure=False)
        )
        body = json.dumps({"kind": "forged"}).encode()
        return await target.publish(aio_pika.Message(body), routing_key=routing_key, mandatory=False)

    return run


def _consume(queue: str) -> Callable[[aio_pika.abc.AbstractChannel], Awaitable[object]]:
    async def run(channel: aio_pika.abc.AbstractChannel) -> object:
        await channel.set_qos(prefetch_count=1)
        found = await channel.get_queue(queue, ensure=False)

        async def ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await message.ack()

        return await found.consume(ignore, arguments={"x-stream-offset": "first"})

    return run


def _declare(queue: str) -> Callable[[aio_pika.abc.AbstractChannel], Awaitable[object]]:
    async def run(channel: aio_pika.abc.AbstractChannel) -> object:
        return await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})

    return run


def _delete(queue: str) -> Callable[[aio_pika.abc.AbstractChannel], Awaitable[object]]:
    async def run(channel: aio_pika.abc.AbstractChannel) -> object:
        return await channel.queue_delete(queue)

    return run


@pytest.fixture(scope="module")
def topology_declared(setup: Setup) -> None:
    """The core topology, as the ingest user declares it at its start."""

    async def declare() -> None:
        async with AmqpBroker(
            setup.urls[USERS[Role.INGEST]], name="test-ingest", connect_timeout_s=15
        ) as broker:
            await topology.declare(broker, Retention())

    asyncio.run(declare())


# What an upstream must not do: register an endpoint (append to the change log), forge breaker commands,
# telemetry, dead letters or retries, read a stream, declare or delete anything.
FORBIDDEN_TO_UPSTREAMS = {
    "append to the endpoint change log": _publish("", topology.ENDPOINT_LOG),
    "publish to an endpoint queue by name": _publish(
        "", topology.endpoint_queue("ep_01JD0000000000000000000000")
    ),
    "publish to a lane by name": _publish("", topology.lane_queue(0)),
    "address a copy to an endpoint": _publish(
        topology.DELAY_DELIVERY, topology.delay_routing_key(0, topology.lane_queue(0))
    ),
    "forge a breaker command": _publish(topology.CONTROL_EXCHANGE, ""),
    "forge telemetry": _publish(topology.TELEMETRY_EXCHANGE, ""),
    "forge a dead letter": _publish(topology.DEAD_LETTER_EXCHANGE, ""),
    "schedule a retry": _publish(topology.delay_level(0), "x"),
    "publish an alert": _publish(topology.ALERTS_EXCHANGE, "x.firing"),
    "read the event log": _consume(topology.EVENT_LOG),
    "read the endpoint change log": _consume(topology.ENDPOINT_LOG),
    "declare a queue": _declare("upstream-own-queue"),
    "delete the event log": _delete(topology.EVENT_LOG),
}


@pytest.mark.usefixtures("topology_declared")
@pytest.mark.parametrize("what", FORBIDDEN_TO_UPSTREAMS)
async def test_an_upstream_cannot_touch_hooklines_internals(setup: Setup, what: str) -> None:
    for user in (setup.acme_upstream, setup.any_upstream):
        assert await _refused(setup.urls[user], FORBIDDEN_TO_UPSTREAMS[what]), f"{user} may {what}"


@pytest.mark.usefixtures("topology_declared")
async def test_a_tenants_upstream_publishes_only_its_tenants_routing_keys(setup: Setup) -> None:
    own = setup.urls[setup.acme_upstream]
    assert not await _refused(own, _publish("events", f"{setup.acme}.order.created"))
    assert await _refused(own, _publish("events", "beta.order.created"))
    assert await _refused(own, _publish("events", f"{setup.acme}x.order.created"))  # a prefix, not a tenant
    assert await _refused(own, _publish("events", setup.acme))  # no dot: no tenant's event
    # An upstream without a tenant publishes for any.
    assert not await _refused(setup.urls[setup.any_upstream], _publish("events", "beta.order.created"))


# Each service is refused what only another role does (the matrix in shared/broker/permissions.py).
FORBIDDEN_TO_ROLES = [
    (Role.DISPATCHER, "publish an event", _publish("events", "acme.order.created")),
    (Role.DISPATCHER, "forge a breaker command", _publish(topology.CONTROL_EXCHANGE, "")),
    (Role.DISPATCHER, "delete the endpoint change log", _delete(topology.ENDPOINT_LOG)),
    (Role.DISPATCHER, "read the event log", _consume(topology.EVENT_LOG)),
    (Role.MONITOR, "forge telemetry", _publish(topology.TELEMETRY_EXCHANGE, "")),
    (Role.MONITOR, "schedule a retry", _publish(topology.delay_level(0), "x")),
    (Role.MONITOR, "delete the dead-letter stream", _delete(topology.DEAD_LETTER_STREAM)),
    (Role.INGEST, "take the monitor's leader lock", _declare(topology.MONITOR_LEADER_LOCK)),
]


@pytest.mark.usefixtures("topology_declared")
@pytest.mark.parametrize(
    ("role", "what", "operation"), FORBIDDEN_TO_ROLES, ids=[w for _, w, _ in FORBIDDEN_TO_ROLES]
)
async def test_each_service_is_refused_what_its_role_does_not_do(
    setup: Setup,
    role: Role,
    what: str,
    operation: Callable[[aio_pika.abc.AbstractChannel], Awaitable[object]],
) -> None:
    assert await _refused(setup.urls[USERS[role]], operation), f"{USERS[role]} may {what}"


@pytest.fixture(scope="module")
def least_privilege_system(
    setup: Setup, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, services.Service]]:
    log_dir: Path = tmp_path_factory.mktemp("least-privilege")
    env = services.base_env(setup.vhost_url, HOOKLINE_STATE_DIR=str(log_dir / "state"), **SERVICE_ENV)
    # The dispatcher and the monitor start first: they wait for the ingest to declare the topology.
    started = {
        "dispatcher": services.start(
            "dispatcher", {**env, "HOOKLINE_AMQP_URL": setup.urls[USERS[Role.DISPATCHER]]}, log_dir
        ),
        "health-monitor": services.start(
            "health-monitor", {**env, "HOOKLINE_AMQP_URL": setup.urls[USERS[Role.MONITOR]]}, log_dir
        ),
    }
    started["ingest"] = services.start(
        "ingest", {**env, "HOOKLINE_AMQP_URL": setup.urls[USERS[Role.INGEST]]}, log_dir
    )
    try:
        for service in started.values():
            service.wait_ready(60)
        yield started
    finally:
        codes = {name: service.stop() for name, service in started.items()}
        logs = "\n".join(service.log() for service in started.values())
        assert set(codes.values()) == {0}, f"exit codes {codes}\n{logs}"


async def test_every_service_works_as_its_own_least_privileged_user(
    setup: Setup, least_privilege_system: dict[str, services.Service], receiver: Receiver, rabbitmq: Broker
) -> None:
    ingest, monitor = least_privilege_system["ingest"], least_privilege_system["health-monitor"]
    acme = setup.acme
    auth = {"authorization": f"Bearer {services.TOKEN}"}
    broken = {"now": True}
    delivered: set[tuple[str, str]] = set()  # (path, webhook-id) answered 2xx

    def respond(request: Received) -> Reply:
        if request.path == "/retired":
            return Reply(status=410)
        if (request.path == "/flaky" and broken["now"]) or (
            request.path == "/refusing" and not delivered_once
        ):
            return Reply(status=500 if request.path == "/flaky" else 400)
        delivered.add((request.path, request.headers["webhook-id"]))
        return Reply(status=204)

    delivered_once: list[str] = []  # /refusing refuses until the test fixes it
    receiver.responder = respond

    async def arrived(path: str, *ids: str) -> bool:
        return {(path, i) for i in ids} <= delivered

    async def api(method: str, path: str, **kwargs: Any) -> httpx.Response:
        async with httpx.AsyncClient(base_url=ingest.base_url, headers=auth, timeout=30) as client:
            return await client.request(method, path, **kwargs)

    def endpoint(path: str, patterns: list[str], **fields: Any) -> dict[str, Any]:
        return {"tenant": acme, "url": receiver.url(path), "event_types": patterns, "verify": False, **fields}

    # Capped, so with a queue of their own (the others are delivered from their lane): one is deleted by
    # hand below, and the other is deleted, its queue then drained and removed.
    ok = (await api("POST", "/v1/endpoints", json=endpoint("/ok", ["order.*"], max_in_flight=10))).json()
    flaky = (await api("POST", "/v1/endpoints", json=endpoint("/flaky", ["invoice.*"]))).json()
    refusing = (await api("POST", "/v1/endpoints", json=endpoint("/refusing", ["refund.*"]))).json()
    gone = (await api("POST", "/v1/endpoints", json=endpoint("/gone", ["order.*"], max_in_flight=10))).json()

    # Events from the HTTP API (the ingest) and from the tenant's own upstream user.
    assert (
        await api(
            "POST", "/v1/events", json={"id": "evt_http", "tenant": acme, "type": "order.created", "data": {}}
        )
    ).status_code == 202
    upstream_event = {
        "id": "evt_amqp",
        "tenant": acme,
        "type": "order.created",
        "occurred_at": "2026-12-01T00:00:00Z",
        "data": {},
    }
    connection = await aio_pika.connect(setup.urls[setup.acme_upstream])
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange("events", ensure=False)
        body = json.dumps(upstream_event).encode()
        await exchange.publish(
            aio_pika.Message(
                body,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                message_id="evt_amqp",
            ),
            routing_key=f"{acme}.order.created",
        )
    await eventually(lambda: arrived("/ok", "evt_http", "evt_amqp"))

    # Retries through the delay queues and a breaker opened and closed by the monitor's commands.
    for n in range(5):
        await api(
            "POST",
            "/v1/events",
            json={"id": f"evt_flaky_{n}", "tenant": acme, "type": "invoice.paid", "data": {}},
        )

    async def breaker(state: str) -> bool:
        async with httpx.AsyncClient(base_url=monitor.base_url, headers=auth, timeout=30) as client:
            response = await client.get(f"/v1/endpoints/{flaky['id']}/health")
        return response.status_code == 200 and response.json()["breaker_state"] == state

    await eventually(lambda: breaker("open"), timeout_s=60)
    broken["now"] = False
    await eventually(lambda: breaker("closed"), timeout_s=60)
    await eventually(lambda: arrived("/flaky", *(f"evt_flaky_{n}" for n in range(5))), timeout_s=60)

    # A refused delivery is a dead letter the ingest lists and redrives.
    await api(
        "POST", "/v1/events", json={"id": "evt_refused", "tenant": acme, "type": "refund.issued", "data": {}}
    )

    async def dead_lettered() -> bool:
        listed = (await api("GET", "/v1/dead-letters", params={"endpoint_id": refusing["id"]})).json()
        return len(listed["data"]) == 1

    await eventually(dead_lettered, timeout_s=30)
    delivered_once.append("fixed")
    redriven = (await api("POST", "/v1/dead-letters/redrive", json={"endpoint_id": refusing["id"]})).json()
    assert redriven["redriven"] == 1
    await eventually(lambda: arrived("/refusing", "evt_refused"), timeout_s=30)

    # A 410 disables the endpoint: the dispatcher writes that to the change log.
    retired = (await api("POST", "/v1/endpoints", json=endpoint("/retired", ["refund.*"]))).json()
    await api(
        "POST", "/v1/events", json={"id": "evt_retired", "tenant": acme, "type": "refund.made", "data": {}}
    )

    async def disabled() -> bool:
        return (await api("GET", f"/v1/endpoints/{retired['id']}")).json()["status"] == "disabled"

    await eventually(disabled, timeout_s=30)

    # Deleting an endpoint: its drained queue is removed (the monitor).
    assert (await api("DELETE", f"/v1/endpoints/{gone['id']}")).status_code == 204
    await eventually(lambda: asyncio.to_thread(lambda: "queue_removed" in monitor.log()), timeout_s=60)

    # An endpoint queue deleted by hand is declared again (a dispatcher or the monitor, as themselves).
    vhost = setup.vhost_url.rsplit("/", 1)[1]
    queue = topology.endpoint_queue(ok["id"])
    await rabbitmq.ctl_async(["delete_queue", "-p", vhost, queue])
    await eventually(lambda: queue_exists(setup.vhost_url, queue), timeout_s=60)
    await api(
        "POST",
        "/v1/events",
        json={"id": "evt_after_repair", "tenant": acme, "type": "order.paid", "data": {}},
    )
    await eventually(lambda: arrived("/ok", "evt_after_repair"), timeout_s=60)

    logs = "\n".join(service.log() for service in least_privilege_system.values())
    assert "access_refused" not in logs.lower(), logs[-3000:]


async def _publish_as(url: str, exchange: str, routing_key: str, body: bytes, **properties: Any) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        target = (
            channel.default_exchange if exchange == "" else await channel.get_exchange(exchange, ensure=False)
        )
        await target.publish(
            aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, **properties),
            routing_key=routing_key,
        )


async def test_a_token_forged_into_the_change_log_by_a_dispatchers_user_is_refused(
    setup: Setup, least_privilege_system: dict[str, services.Service]
) -> None:
    """A dispatcher's user may append to the change log (to disable an endpoint), never a token."""
    ingest = least_privilege_system["ingest"]
    forged, prefix, digest = tenants.new_token()
    record = TokenUpserted(
        change_id="chg_forged",
        at=datetime.now(UTC),
        token=StoredToken(
            id=ids.new_id("tok"),
            tenant=setup.acme,
            prefix=prefix,
            digest=digest,
            created_at=datetime.now(UTC),
        ),
    )
    dispatcher_url = setup.urls[USERS[Role.DISPATCHER]]
    await _publish_as(
        dispatcher_url,
        "",
        topology.ENDPOINT_LOG,
        record.model_dump_json().encode(),
        user_id=USERS[Role.DISPATCHER],
    )
    # A real token, created after it, is the sentinel: once it works, the forged record was read.
    auth = {"authorization": f"Bearer {services.TOKEN}"}
    async with httpx.AsyncClient(base_url=ingest.base_url, timeout=30) as api:
        real = (await api.post("/v1/tokens", json={"tenant": setup.acme}, headers=auth)).json()["token"]

        async def works(token: str) -> bool:
            return (
                await api.get("/v1/whoami", headers={"authorization": f"Bearer {token}"})
            ).status_code == 200

        await eventually(lambda: works(real))
        assert not await works(forged)
    assert "tenant_record_refused" in ingest.log()


async def test_an_event_whose_body_claims_another_tenant_is_not_that_tenants(
    setup: Setup, least_privilege_system: dict[str, services.Service]
) -> None:
    """The acme upstream may publish acme.* keys only; a body naming another tenant is not logged,
    listed, counted or replayed as that tenant's."""
    ingest = least_privilege_system["ingest"]
    victim = tenant()
    claim = {
        "id": "evt_claims_another",
        "tenant": victim,
        "type": "order.created",
        "occurred_at": "2026-12-01T00:00:00Z",
        "data": {},
    }
    own = {**claim, "id": "evt_sentinel_own", "tenant": setup.acme}
    upstream = setup.urls[setup.acme_upstream]
    await _publish_as(
        upstream, "events", f"{setup.acme}.order.created", json.dumps(claim).encode(), message_id=claim["id"]
    )
    await _publish_as(
        upstream, "events", f"{setup.acme}.order.created", json.dumps(own).encode(), message_id=own["id"]
    )
    auth = {"authorization": f"Bearer {services.TOKEN}"}
    async with httpx.AsyncClient(base_url=ingest.base_url, headers=auth, timeout=30) as api:

        async def logged(tenant_name: str) -> list[str]:
            listed = (await api.get("/v1/events", params={"tenant": tenant_name})).json()["data"]
            return [event["id"] for event in listed]

        await eventually(lambda: _contains(logged(setup.acme), "evt_sentinel_own"))
        assert await logged(victim) == []
        assert "evt_claims_another" not in await logged(setup.acme)
        usage = (await api.get(f"/v1/tenants/{victim}/quota")).json()["usage"]
        assert usage["events_today"] == 0


async def _contains(found: Awaitable[list[str]], wanted: str) -> bool:
    return wanted in await found
