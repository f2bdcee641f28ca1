"""`hookline broker-setup --management-url` (as compose runs it) against a real management API: a node
of its own with the management plugin, started by scripts/start-rabbitmq-cluster.sh."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import aiormq
import pytest

from hookline.shared.broker.permissions import USERS, Role

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "start-rabbitmq-cluster.sh"
HOOKLINE = str(Path(sys.executable).with_name("hookline"))
PORT = 5695
NODE_ENV = {
    "HOOKLINE_CLUSTER_NODES": "1",
    "HOOKLINE_CLUSTER_PORT": str(PORT),
    "HOOKLINE_CLUSTER_DIR": "/var/lib/rabbitmq/hookline-management-test",
    "HOOKLINE_CLUSTER_MANAGEMENT": "1",
}


def node(*arguments: str) -> str:
    done = subprocess.run(
        [str(SCRIPT), *arguments], env={**os.environ, **NODE_ENV}, capture_output=True, text=True, timeout=240,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def management_node() -> Iterator[str]:
    node("start")
    try:
        yield f"http://guest:guest@127.0.0.1:{PORT + 10000}"
    finally:
        node("reset")  # the node and its data: nothing left behind


def _setup(management_url: str, *arguments: str) -> dict[str, object]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("HOOKLINE_")}
    env["HOOKLINE_AMQP_URL"] = f"amqp://127.0.0.1:{PORT}/hookline"
    env[f"HOOKLINE_BROKER_PASSWORD_{USERS[Role.INGEST].upper().replace('-', '_')}"] = (
        "ingest-password-0123456789"
    )
    done = subprocess.run(
        [HOOKLINE, "broker-setup", "--management-url", management_url, *arguments],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    output: dict[str, object] = json.loads(done.stdout)
    return output


async def _publish(url: str, routing_key: str) -> bool:
    """Whether the broker took the publish (False: ACCESS_REFUSED)."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange("events", ensure=False)
        try:
            await exchange.publish(aio_pika.Message(b"{}"), routing_key=routing_key)
        except aiormq.exceptions.ChannelAccessRefused:
            return False
    return True


def test_broker_setup_through_the_management_api(management_node: str) -> None:
    output = _setup(management_node, "--upstream", "orders:acme")
    assert output["vhost"] == "hookline"
    users = {user["user"]: user for user in output["users"]}  # type: ignore[attr-defined]
    assert users["hookline-ingest"]["password"] is None  # given, so not echoed
    upstream_url = users["orders"]["amqp_url"]
    assert upstream_url.startswith(f"amqp://orders:{users['orders']['password']}@127.0.0.1:{PORT}/hookline")

    # The ingest's user declares the topology (as the ingest does), then the upstream publishes.
    from hookline.shared.broker import topology
    from hookline.shared.broker.amqp import Broker
    from hookline.shared.broker.topology import Retention

    async def run() -> None:
        ingest_url = f"amqp://hookline-ingest:ingest-password-0123456789@127.0.0.1:{PORT}/hookline"
        async with Broker(ingest_url, name="test-ingest", connect_timeout_s=15) as broker:
            await topology.declare(broker, Retention())
        assert await _publish(upstream_url, "acme.order.created")
        assert not await _publish(upstream_url, "beta.order.created")

    asyncio.run(run())

    # Again: every password kept (none shown), the tenant limit still there.
    again = _setup(management_node, "--upstream", "orders:acme")
    assert all(user["password"] is None for user in again["users"])  # type: ignore[attr-defined]
    assert not asyncio.run(_publish(upstream_url, "beta.order.created"))
    assert asyncio.run(_publish(upstream_url, "acme.order.created"))
