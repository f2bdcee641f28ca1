"""Local state never stops a service, with the real services: every SQLite file the ingest and the
monitor keep is overwritten with garbage (one truncated instead) while they are stopped; started again
on their ports, they set each file aside, say so once, count it, are ready, and answer from views
rebuilt from the streams with what they answered before."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import services
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

SYSTEM_ENV = {"HOOKLINE_TICK_S": "0.2"}
AUTH = {"authorization": f"Bearer {services.TOKEN}"}


async def get(service: services.Service, path: str, **params: str) -> Any:
    async with httpx.AsyncClient(base_url=service.base_url, headers=AUTH, timeout=30) as client:
        response = await client.get(path, params=params)
    return response.json() if response.status_code == 200 else None


def log_lines(service: services.Service, event: str) -> list[dict[str, Any]]:
    lines = (json.loads(line) for line in service.log().splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == event]


async def set_aside_counted(service: services.Service) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=service.base_url, headers=AUTH, timeout=30) as client:
        text = (await client.get("/metrics")).text
    return {
        sample.labels["file"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "hookline_state_files_set_aside_total"
    }


def state_files(system: System, service: services.Service, prefix: str) -> list[Path]:
    return sorted(Path(system.env["HOOKLINE_STATE_DIR"]).glob(f"{prefix}-{service.port}*.sqlite"))


def damage(files: list[Path]) -> Path:
    """Garbage over every file but the attempts, which is truncated to half; returns that one."""
    truncated = next(path for path in files if path.name.endswith(".attempts.sqlite"))
    for path in files:
        if path == truncated:
            os.truncate(path, path.stat().st_size // 2)
        else:
            path.write_bytes(os.urandom(path.stat().st_size))
    return truncated


def check_said(said: list[dict[str, Any]], files: list[Path], truncated: Path) -> None:
    """One alert line per file, naming it, where it went and what SQLite said."""
    assert sorted(line["path"] for line in said) == sorted(str(path) for path in files), "each once"
    for line in said:
        assert line["level"] == "error"
        assert line["alert"] is True
        damage = (
            "database disk image is malformed" if line["path"] == str(truncated) else "file is not a database"
        )
        assert line["error"] == damage
        moved = Path(line["moved_to"])
        assert moved.exists()
        assert moved.name.startswith(Path(line["path"]).name + ".corrupt-")


async def test_garbage_over_every_local_file_costs_a_rebuild_not_the_service(
    system: System, receiver: Receiver
) -> None:
    def respond(request: Received) -> Reply:
        return Reply(status=400 if request.path == "/refuses" else 204)

    receiver.responder = respond
    acme = tenant()
    ok = system.add_endpoint(acme, receiver.url("/ok"), ["#"])
    refuses = system.add_endpoint(acme, receiver.url("/refuses"), ["#"])
    with system.api() as api:
        published = api.post("/v1/events", json={"tenant": acme, "type": "order.created", "data": {}})
    assert published.status_code == 202, published.text
    event_id = published.json()["id"]

    async def answers() -> dict[str, Any] | None:
        """What the ingest and the monitor answer from their views, once every view has it all."""
        found = {
            "story": await get(system.ingest, f"/v1/events/{event_id}"),
            "dead_letters": await get(system.ingest, "/v1/dead-letters", tenant=acme),
            "audit": await get(system.ingest, "/v1/audit", tenant=acme),
            "health": await get(system.monitor, f"/v1/endpoints/{ok['id']}/health"),
            "analysis": await get(system.monitor, "/v1/dead-letters/analysis", tenant=acme),
        }
        if any(value is None for value in found.values()):
            return None
        states = {course["endpoint_id"]: course["state"] for course in found["story"]["endpoints"]}
        complete = (
            states == {ok["id"]: "delivered", refuses["id"]: "dead"}
            and len(found["dead_letters"]["data"]) == 1
            and len(found["audit"]["data"]) == 2
            and found["health"]["samples"] == 1
            and len(found["analysis"]) == 1
        )
        return found if complete else None

    before = await eventually(answers, timeout_s=30)

    assert system.ingest.stop() == 0
    assert system.monitor.stop() == 0
    files = state_files(system, system.ingest, "ingest") + state_files(
        system, system.monitor, "health-monitor"
    )
    names = [path.name.split("-", 2)[-1] if path.name.startswith("health") else path.name for path in files]
    assert len(files) == 6, names  # dead letters, events, attempts, audit; dead letters, checkpoint
    truncated = damage(files)

    system.ingest = system.start_again(system.ingest)  # ready: wait_ready
    system.monitor = system.start_again(system.monitor)
    after = await eventually(answers, timeout_s=60)
    assert after["story"]["endpoints"] == before["story"]["endpoints"]
    assert after["dead_letters"] == before["dead_letters"]
    assert after["audit"] == before["audit"]
    for key in ("samples", "p50_ms", "p95_ms", "success_rate", "breaker_state"):
        assert after["health"][key] == before["health"][key], key
    assert after["analysis"] == before["analysis"]

    said = log_lines(system.ingest, "state_file_set_aside") + log_lines(
        system.monitor, "state_file_set_aside"
    )
    check_said(said, files, truncated)
    counted = await set_aside_counted(system.ingest) | await set_aside_counted(system.monitor)
    assert counted == {path.name: 1.0 for path in files}
