"""Backing up the change log and restoring it into a broker that lost everything, with the real services.

A system with endpoints (one with a rotated secret, one paused, one with a notify_url, hence a
notifier), an event type, a tenant token and a quota is exported with ``hookline export``; its vhost is
deleted and created again, empty; ``hookline import`` restores it (twice: the second changes nothing),
and the services started on it deliver to every restored endpoint, signed with the secrets it had.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook
from support import services
from support.broker import Broker
from support.receiver import Received, Receiver
from support.system import System, services_running, tenant
from support.waiting import eventually

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
    with rabbitmq.vhost("backup-restore") as amqp_url:
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
