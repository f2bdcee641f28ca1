"""The broker's capacity: both parsers on recorded answers, the choice of source, and the reader against
real stand-ins (executable scripts for the CLI, an HTTP server for the management API)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from structlog.testing import capture_logs

from hookline.shared.broker.capacity import (
    BrokerCapacity,
    CapacityReader,
    CapacityUnreadableError,
    from_diagnostics,
    from_management,
)

LOCAL_AMQP = "amqp://guest:guest@localhost:5672/"

# `rabbitmq-diagnostics -q status --formatter json` on RabbitMQ 3.10, trimmed to what matters here.
STATUS: dict[str, Any] = {
    "alarms": [],
    "disk_free": 84472352768,
    "disk_free_limit": 50000000,
    "file_descriptors": {"sockets_limit": 832, "sockets_used": 4, "total_limit": 927, "total_used": 127},
    "listeners": [
        {"interface": "127.0.0.1", "node": "rabbit@localhost", "port": 5672, "protocol": "amqp"},
    ],
    "memory": {"total": {"erlang": 78825520, "rss": 173764608}},
    "pid": 2936,
    "rabbitmq_version": "3.10.8",
    "totals": {"virtual_host_count": 3, "connection_count": 4, "queue_count": 46},
}
DISK_ALARM = {"node": "rabbit@localhost", "resource": "disk", "type": "resource_limit"}
MEMORY_ALARM = {"node": "rabbit@localhost", "resource": "memory", "type": "resource_limit"}
NO_LISTENERS = {key: value for key, value in STATUS.items() if key != "listeners"}


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        pytest.param(
            STATUS,
            {
                "source": "diagnostics",
                "nodes": ["rabbit@localhost"],
                "memory_alarm": False,
                "disk_alarm": False,
                "alarms": [],
                "disk_free_bytes": 84472352768,
                "disk_free_limit_bytes": 50000000,
                "fd_used": 127,
                "fd_limit": 927,
                "queues": 46,
            },
            id="no-alarm",
        ),
        pytest.param(
            {**STATUS, "alarms": [MEMORY_ALARM]},
            {"memory_alarm": True, "disk_alarm": False, "alarms": ["memory alarm on rabbit@localhost"]},
            id="memory-alarm",
        ),
        pytest.param(
            {**STATUS, "alarms": [DISK_ALARM]},
            {"memory_alarm": False, "disk_alarm": True, "alarms": ["disk alarm on rabbit@localhost"]},
            id="disk-alarm",
        ),
        pytest.param(
            {**STATUS, "alarms": [DISK_ALARM, MEMORY_ALARM]},
            {
                "memory_alarm": True,
                "disk_alarm": True,
                "alarms": ["disk alarm on rabbit@localhost", "memory alarm on rabbit@localhost"],
            },
            id="both-alarms",
        ),
        pytest.param(
            {**STATUS, "alarms": [{**MEMORY_ALARM, "node": "rabbit@other"}]},
            {"nodes": ["rabbit@localhost"], "memory_alarm": True, "alarms": ["memory alarm on rabbit@other"]},
            id="alarm-of-another-cluster-node",
        ),
        pytest.param(
            {**STATUS, "alarms": [{"node": "rabbit@localhost", "resource": "file_descriptors"}]},
            {
                "memory_alarm": False,
                "disk_alarm": False,
                "alarms": ["file descriptor alarm on rabbit@localhost"],
            },
            id="file-descriptor-alarm",
        ),
        pytest.param(
            {**NO_LISTENERS, "alarms": [MEMORY_ALARM]}, {"nodes": ["rabbit@localhost"]}, id="node-from-alarm"
        ),
        pytest.param(NO_LISTENERS, {"nodes": ["local"]}, id="node-unnamed"),
        pytest.param(
            {key: value for key, value in STATUS.items() if key not in ("file_descriptors", "totals")},
            {"fd_used": None, "fd_limit": None, "queues": None, "disk_free_bytes": 84472352768},
            id="4x-without-fd-numbers",
        ),
        pytest.param(
            {**STATUS, "file_descriptors": {"total_limit": 0, "total_used": 0}},
            {"fd_used": 0, "fd_limit": None},
            id="4x-zero-fd-limit",
        ),
        pytest.param(
            {
                **STATUS,
                "disk_free": "unknown",
                "file_descriptors": {"total_limit": "unknown", "total_used": True},
            },
            {"disk_free_bytes": None, "disk_free_limit_bytes": 50000000, "fd_used": None, "fd_limit": None},
            id="unknown-strings",
        ),
    ],
)
def test_diagnostics_status_is_read(status: dict[str, Any], expected: dict[str, Any]) -> None:
    capacity = from_diagnostics(status)
    assert {key: getattr(capacity, key) for key in expected} == expected


def test_headroom_is_limit_minus_use() -> None:
    capacity = from_diagnostics(STATUS)
    assert capacity.fd_headroom == 927 - 127
    assert capacity.disk_headroom_bytes == 84472352768 - 50000000
    unknown = from_diagnostics({**STATUS, "disk_free_limit": "unknown", "file_descriptors": {}})
    assert unknown.fd_headroom is None
    assert unknown.disk_headroom_bytes is None


@pytest.mark.parametrize(
    "status",
    [
        pytest.param([], id="a-list"),
        pytest.param("Error: unable to perform an operation on node", id="a-string"),
        pytest.param({"disk_free": 1}, id="no-alarms"),
        pytest.param({**STATUS, "alarms": "none"}, id="alarms-not-a-list"),
        pytest.param({**STATUS, "alarms": [42]}, id="alarm-not-an-object"),
        pytest.param({**STATUS, "alarms": [{"node": "rabbit@localhost"}]}, id="alarm-without-resource"),
    ],
)
def test_a_malformed_status_is_refused(status: Any) -> None:
    with pytest.raises(CapacityUnreadableError, match="rabbitmq-diagnostics status"):
        from_diagnostics(status)


def node(name: str, **fields: Any) -> dict[str, Any]:
    """A node of ``GET /api/nodes``: healthy, with 10 GB over the disk limit and 900 free file handles."""
    healthy = {
        "mem_alarm": False,
        "disk_free_alarm": False,
        "disk_free": 10_050_000_000,
        "disk_free_limit": 50_000_000,
        "fd_used": 124,
        "fd_total": 1024,
        "running": True,
    }
    return {"name": name, **healthy, **fields}


OVERVIEW = {"object_totals": {"queues": 12, "connections": 3}}


@pytest.mark.parametrize(
    ("nodes", "overview", "expected"),
    [
        pytest.param(
            [node("rabbit@a")],
            OVERVIEW,
            {
                "source": "management",
                "nodes": ["rabbit@a"],
                "memory_alarm": False,
                "disk_alarm": False,
                "alarms": [],
                "disk_free_bytes": 10_050_000_000,
                "disk_free_limit_bytes": 50_000_000,
                "fd_used": 124,
                "fd_limit": 1024,
                "queues": 12,
            },
            id="no-alarm",
        ),
        pytest.param(
            [node("rabbit@a", mem_alarm=True)],
            OVERVIEW,
            {"memory_alarm": True, "disk_alarm": False, "alarms": ["memory alarm on rabbit@a"]},
            id="memory-alarm",
        ),
        pytest.param(
            [node("rabbit@a", disk_free_alarm=True)],
            OVERVIEW,
            {"memory_alarm": False, "disk_alarm": True, "alarms": ["disk alarm on rabbit@a"]},
            id="disk-alarm",
        ),
        pytest.param(
            [node("rabbit@a", mem_alarm=True, disk_free_alarm=True)],
            OVERVIEW,
            {
                "memory_alarm": True,
                "disk_alarm": True,
                "alarms": ["memory alarm on rabbit@a", "disk alarm on rabbit@a"],
            },
            id="both-alarms",
        ),
        pytest.param(
            # a has more disk but a higher limit (less headroom); b has more file handles in use.
            [
                node("rabbit@a", disk_free=2_000_000_000, disk_free_limit=1_900_000_000),
                node("rabbit@b", disk_free=500_000_000, fd_used=1000, mem_alarm=True),
            ],
            OVERVIEW,
            {
                "nodes": ["rabbit@a", "rabbit@b"],
                "memory_alarm": True,
                "alarms": ["memory alarm on rabbit@b"],
                "disk_free_bytes": 2_000_000_000,
                "disk_free_limit_bytes": 1_900_000_000,
                "fd_used": 1000,
                "fd_limit": 1024,
            },
            id="cluster-worst-node",
        ),
        pytest.param(
            [node("rabbit@a", fd_used=10, fd_total=0), node("rabbit@b", fd_total=None)],
            OVERVIEW,
            {"fd_used": 10, "fd_limit": None},
            id="4x-without-fd-limit",
        ),
        pytest.param(
            [node("rabbit@a", disk_free="unknown", fd_used="unknown", fd_total="unknown")],
            {"object_totals": {"queues": "unknown"}},
            {
                "disk_free_bytes": None,
                "disk_free_limit_bytes": 50_000_000,
                "fd_used": None,
                "fd_limit": None,
                "queues": None,
            },
            id="unknown-strings",
        ),
        pytest.param(
            # a stopped node reports its name and little else: the running one's numbers stand.
            [{"name": "rabbit@down", "running": False}, node("rabbit@up", fd_used=300)],
            {},
            {
                "nodes": ["rabbit@down", "rabbit@up"],
                "fd_used": 300,
                "disk_free_bytes": 10_050_000_000,
                "queues": None,
            },
            id="a-node-down",
        ),
    ],
)
def test_management_answers_are_read(
    nodes: list[dict[str, Any]], overview: dict[str, Any], expected: dict[str, Any]
) -> None:
    capacity = from_management(nodes, overview)
    assert {key: getattr(capacity, key) for key in expected} == expected


@pytest.mark.parametrize(
    ("nodes", "overview", "message"),
    [
        pytest.param({"name": "rabbit@a"}, OVERVIEW, "GET /api/nodes", id="nodes-not-a-list"),
        pytest.param([], OVERVIEW, "GET /api/nodes", id="no-nodes"),
        pytest.param(["rabbit@a"], OVERVIEW, "GET /api/nodes", id="node-not-an-object"),
        pytest.param([{"running": True}], OVERVIEW, "GET /api/nodes", id="node-without-name"),
        pytest.param([node("rabbit@a")], [], "GET /api/overview", id="overview-not-an-object"),
    ],
)
def test_malformed_management_answers_are_refused(nodes: Any, overview: Any, message: str) -> None:
    with pytest.raises(CapacityUnreadableError, match=message):
        from_management(nodes, overview)


def script(tmp_path: Path, name: str, body: str) -> str:
    """An executable shell script standing in for ``rabbitmq-diagnostics``; its path."""
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def answering(tmp_path: Path, status: dict[str, Any] = STATUS, name: str = "diagnostics") -> str:
    """A stand-in that checks its arguments, counts its runs in ``runs`` (each with its niceness) and
    prints ``status``."""
    runs = tmp_path / "runs"
    return script(
        tmp_path,
        name,
        f'[ "$*" = "-q status --formatter json" ] || {{ echo "unexpected arguments: $*" >&2; exit 2; }}\n'
        f"echo \"run $(nice)\" >> '{runs}'\n"
        f"cat <<'EOF'\n{json.dumps(status)}\nEOF\n",
    )


def runs(tmp_path: Path) -> int:
    path = tmp_path / "runs"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize(
    ("management_url", "command", "amqp_url", "expected"),
    [
        pytest.param(
            "http://rabbit.internal:15672", None, "amqp://u:p@rabbit.internal/", "management", id="management"
        ),
        pytest.param("http://localhost:15672", "FAKE", LOCAL_AMQP, "management", id="management-first"),
        pytest.param(None, "FAKE", LOCAL_AMQP, "diagnostics", id="localhost"),
        pytest.param(None, "FAKE", "amqp://guest:guest@127.0.0.1:5672/vh", "diagnostics", id="ipv4-loopback"),
        pytest.param(None, "FAKE", "amqp://guest:guest@[::1]:5672/", "diagnostics", id="ipv6-loopback"),
        pytest.param(None, "FAKE", "amqps://u:p@rabbit.internal:5671/", None, id="remote-broker"),
        pytest.param(None, "hookline-no-such-command", LOCAL_AMQP, None, id="not-on-path"),
        pytest.param(None, None, LOCAL_AMQP, None, id="nothing-configured"),
    ],
)
def test_the_source_is_chosen(
    tmp_path: Path, management_url: str | None, command: str | None, amqp_url: str, expected: str | None
) -> None:
    command = answering(tmp_path) if command == "FAKE" else command
    reader = CapacityReader(management_url=management_url, diagnostics_command=command, amqp_url=amqp_url)
    assert reader.source == expected


def test_a_command_name_is_looked_up_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = answering(tmp_path, name="rabbitmq-diagnostics")
    monkeypatch.setenv("PATH", str(tmp_path))
    reader = CapacityReader(
        management_url=None, diagnostics_command="rabbitmq-diagnostics", amqp_url=LOCAL_AMQP
    )
    assert (reader.source, reader.target) == ("diagnostics", path)


async def test_without_a_source_read_raises_and_recent_is_none() -> None:
    async with CapacityReader(management_url=None, diagnostics_command=None, amqp_url=LOCAL_AMQP) as reader:
        with pytest.raises(CapacityUnreadableError, match="no source"):
            await reader.read()
        with capture_logs() as logs:
            assert await reader.recent(max_age_s=5) is None
    assert logs == []


async def test_diagnostics_are_read_from_the_command(tmp_path: Path) -> None:
    command = answering(tmp_path, {**STATUS, "alarms": [MEMORY_ALARM]})
    async with CapacityReader(
        management_url=None, diagnostics_command=command, amqp_url=LOCAL_AMQP
    ) as reader:
        capacity = await reader.read()
    assert capacity == from_diagnostics({**STATUS, "alarms": [MEMORY_ALARM]})
    assert capacity.memory_alarm
    # Run at the lowest priority: it boots an Erlang VM, on a machine the dispatchers may share.
    assert (tmp_path / "runs").read_text().split() == ["run", "19"]


async def test_a_failing_command_names_itself_and_its_error(tmp_path: Path) -> None:
    command = script(
        tmp_path, "failing", "echo 'Error: unable to perform an operation on node' >&2\nexit 1\n"
    )
    async with CapacityReader(
        management_url=None, diagnostics_command=command, amqp_url=LOCAL_AMQP
    ) as reader:
        with pytest.raises(CapacityUnreadableError) as raised:
            await reader.read()
    assert (
        str(raised.value)
        == f"{command} -q status: exit status 1: Error: unable to perform an operation on node"
    )


async def test_output_that_is_not_json_is_refused(tmp_path: Path) -> None:
    command = script(tmp_path, "chatty", "echo 'Status of node rabbit@localhost ...'\n")
    async with CapacityReader(
        management_url=None, diagnostics_command=command, amqp_url=LOCAL_AMQP
    ) as reader:
        with pytest.raises(CapacityUnreadableError, match="not JSON"):
            await reader.read()


def gone(pid: int) -> bool:
    """The process has exited (a zombie no one reaped yet counts: it runs no more)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_a_hung_command_is_killed_with_its_children(tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    command = script(tmp_path, "hung", f"sleep 30 &\necho $! > '{child}'\nwait\n")
    reader = CapacityReader(
        management_url=None, diagnostics_command=command, amqp_url=LOCAL_AMQP, timeout_s=0.5
    )
    started_s = time.monotonic()
    async with reader:
        with pytest.raises(CapacityUnreadableError, match=r"no answer within 0\.5s"):
            await reader.read()
    # Not held until the orphaned `sleep 30` lets go of the pipes: killed with its children at the timeout.
    assert time.monotonic() - started_s < 15
    pid = int(child.read_text())
    for _ in range(50):  # SIGKILL is delivered asynchronously
        if gone(pid):
            break
        await asyncio.sleep(0.02)
    assert gone(pid)


async def test_recent_keeps_a_reading_for_max_age(tmp_path: Path) -> None:
    now_s = [100.0]
    command = answering(tmp_path)
    async with CapacityReader(
        management_url=None, diagnostics_command=command, amqp_url=LOCAL_AMQP, clock=lambda: now_s[0]
    ) as reader:
        first = await reader.recent(max_age_s=5)
        assert isinstance(first, BrokerCapacity)
        now_s[0] = 104.9
        assert await reader.recent(max_age_s=5) is first
        assert runs(tmp_path) == 1
        now_s[0] = 105.0
        assert await reader.recent(max_age_s=5) == first
        assert runs(tmp_path) == 2
        together = await asyncio.gather(*(reader.recent(max_age_s=0) for _ in range(3)))
        assert all(reading == first for reading in together)
        assert runs(tmp_path) == 5  # one at a time, each its own read (nothing is younger than 0 s)


async def test_recent_is_none_on_failure_and_warns_once_a_minute(tmp_path: Path) -> None:
    now_s = [0.0]
    attempts = tmp_path / "attempts"
    command = script(tmp_path, "failing", f"echo attempt >> '{attempts}'\necho 'node down' >&2\nexit 69\n")
    async with CapacityReader(
        management_url=None, diagnostics_command=command, amqp_url=LOCAL_AMQP, clock=lambda: now_s[0]
    ) as reader:
        with capture_logs() as logs:
            for at_s in (0.0, 1.0, 10.0, 30.0, 61.0):
                now_s[0] = at_s
                assert await reader.recent(max_age_s=5) is None
    # 1.0 is within max_age of the failure at 0.0: the broken source is not asked again.
    assert len(attempts.read_text().splitlines()) == 4
    assert [(log["event"], log["log_level"]) for log in logs] == [
        ("broker_capacity_unreadable", "warning")
    ] * 2
    assert logs[0]["source"] == "diagnostics"
    assert "exit status 69: node down" in logs[0]["error"]


@asynccontextmanager
async def management_api(
    answer: Callable[[web.Request], web.StreamResponse],
) -> AsyncIterator[tuple[str, list[web.Request]]]:
    """A real HTTP server on 127.0.0.1 standing in for the management plugin: its host:port and requests."""
    seen: list[web.Request] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        seen.append(request)
        return answer(request)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


def plugin(request: web.Request) -> web.StreamResponse:
    if request.path.endswith("/api/nodes"):
        return web.json_response([node("rabbit@a", disk_free_alarm=True)])
    if request.path.endswith("/api/overview"):
        return web.json_response(OVERVIEW)
    return web.json_response({"error": "Object Not Found"}, status=404)


@pytest.mark.parametrize(
    ("management_url", "amqp_url", "authorization"),
    [
        pytest.param(
            "http://monitor:s3cret@{address}", LOCAL_AMQP, "bW9uaXRvcjpzM2NyZXQ=", id="own-credentials"
        ),
        pytest.param(
            "http://{address}", "amqp://app:p%40ss@localhost/", "YXBwOnBAc3M=", id="amqp-credentials"
        ),
        pytest.param("http://{address}/rabbitmq/", LOCAL_AMQP, "Z3Vlc3Q6Z3Vlc3Q=", id="under-a-path"),
    ],
)
async def test_the_management_api_is_read_with_basic_auth(
    management_url: str, amqp_url: str, authorization: str
) -> None:
    async with management_api(plugin) as (address, seen):
        url = management_url.format(address=address)
        async with CapacityReader(management_url=url, diagnostics_command=None, amqp_url=amqp_url) as reader:
            assert reader.target is not None
            assert "@" not in reader.target
            capacity = await reader.read()
    assert capacity == from_management([node("rabbit@a", disk_free_alarm=True)], OVERVIEW)
    assert [request.path.removeprefix("/rabbitmq") for request in seen] == ["/api/nodes", "/api/overview"]
    assert {request.headers["Authorization"] for request in seen} == {f"Basic {authorization}"}


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_credentials_never_appear_in_errors() -> None:
    def refuse(_: web.Request) -> web.StreamResponse:
        return web.Response(status=401, text="Not_Authorized")

    def garble(_: web.Request) -> web.StreamResponse:
        return web.Response(text="<html>login</html>")

    errors = []
    async with management_api(refuse) as (refusing, _), management_api(garble) as (garbling, _):
        for address in (refusing, garbling, f"127.0.0.1:{closed_port()}"):
            url = f"http://monitor:s3cret-pw@{address}"
            async with CapacityReader(
                management_url=url, diagnostics_command=None, amqp_url=LOCAL_AMQP
            ) as reader:
                with pytest.raises(CapacityUnreadableError) as raised:
                    await reader.read()
                errors.append(str(raised.value))
    assert errors[0] == f"management API at http://{refusing}: HTTP 401 for /api/nodes"
    assert errors[1] == f"management API at http://{garbling}: the answer is not JSON"
    assert errors[2].startswith("management API at http://127.0.0.1:")
    assert "ConnectError" in errors[2]
    assert not [error for error in errors if "s3cret" in error or "monitor" in error]


@pytest.mark.integration
async def test_the_real_diagnostics_describe_the_local_broker() -> None:
    command = shutil.which("rabbitmq-diagnostics")
    if command is None:
        if os.environ.get("CI"):
            pytest.fail("rabbitmq-diagnostics is not on PATH, and CI is expected to have it")
        pytest.skip("rabbitmq-diagnostics is not on PATH")
    async with CapacityReader(
        management_url=None, diagnostics_command=command, amqp_url=LOCAL_AMQP, timeout_s=60
    ) as reader:
        capacity = await reader.read()
    assert capacity.source == "diagnostics"
    assert capacity.nodes[0].startswith("rabbit@")
    assert capacity.disk_free_bytes is not None
    assert capacity.disk_free_bytes > 0
    assert capacity.queues is not None
