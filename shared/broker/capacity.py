"""The broker's resource picture: memory and disk alarms, free disk, file handles and the number of queues.

AMQP tells a client nothing about how close the broker is to its limits: it blocks publishers once an
alarm is raised, too late for the health monitor to warn anyone, and never mentions file handles, which
every queue and connection holds; when they run out, declares fail halfway through a change. So the
health monitor alerts on these numbers, and the ingest refuses a new endpoint (and the queue it needs)
when the broker's file handles would not stretch to it.

Two sources know the numbers. The management plugin's HTTP API covers every node of a cluster. The
``rabbitmq-diagnostics`` CLI needs no plugin but only ever talks to the node on this machine, so it is
used only when the AMQP URL points here too; otherwise it would describe the wrong broker. The parsers
are pure, so recorded answers of either source are tested without a broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx
import orjson
import structlog
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from hookline.shared.runtime.settings import CommonSettings

log = structlog.get_logger(__name__)

Source = Literal["management", "diagnostics"]
Pair = tuple[int | None, int | None]
_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
_WARN_EVERY_S = 60.0  # a broker that stays unreadable must not fill the log once per tick
#: File handles RabbitMQ 3.x accounts for each quorum queue (measured: 1,502 for 500 queues), though an idle
#: one keeps no file open; once the account is full it hangs new connections. 4.x keeps no such account.
QUORUM_QUEUE_FILE_HANDLES = 3
_ALARM_WORDS = {"memory": "memory alarm", "disk": "disk alarm", "file_descriptors": "file descriptor alarm"}


class CapacityUnreadableError(Exception):
    """No source, or the source failed or answered in a shape this module does not know."""


class BrokerCapacity(BaseModel):
    """One reading. Alarms are those of any node; disk and file handle numbers are the tightest node's."""

    model_config = ConfigDict(frozen=True)

    source: Source
    nodes: list[str]
    memory_alarm: bool
    disk_alarm: bool
    alarms: list[str]
    disk_free_bytes: int | None
    disk_free_limit_bytes: int | None
    fd_used: int | None
    fd_limit: int | None
    queues: int | None  # all vhosts

    @property
    def fd_headroom(self) -> int | None:
        return None if self.fd_used is None or self.fd_limit is None else self.fd_limit - self.fd_used

    @property
    def disk_headroom_bytes(self) -> int | None:
        free, limit = self.disk_free_bytes, self.disk_free_limit_bytes
        return None if free is None or limit is None else free - limit


def _count(value: object) -> int | None:
    # Versions differ: a number may be missing or the string "unknown"; bool is an int to Python, not here.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _limit(value: object) -> int | None:
    return _count(value) or None  # RabbitMQ 4 dropped its file handle accounting and may report a 0 limit


def _mapping(value: object, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise CapacityUnreadableError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


def _section(parent: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = parent.get(key)  # optional: versions leave out different parts
    return value if isinstance(value, Mapping) else {}


def _tightest(pairs: Sequence[Pair], headroom: Callable[[int, int], int]) -> Pair:
    """The pair of the node with the least headroom; one with unknown headroom only if no node's is known."""

    def key(pair: Pair) -> tuple[int, int]:
        amount, limit = pair
        return (1, 0) if amount is None or limit is None else (0, headroom(amount, limit))

    return min(pairs, key=key, default=(None, None))


def from_diagnostics(status: Mapping[str, Any]) -> BrokerCapacity:
    """A reading from the JSON of ``rabbitmq-diagnostics -q status --formatter json`` (one node's view)."""
    what = "rabbitmq-diagnostics status"
    status = _mapping(status, what)
    if not isinstance(status.get("alarms"), list):
        raise CapacityUnreadableError(f"{what}: no 'alarms' list; is this the output of 'status'?")
    raised: list[tuple[str, str]] = []  # (resource, node)
    for entry in status["alarms"]:
        alarm = _mapping(entry, f"{what}: an alarm")
        resource, node = alarm.get("resource"), alarm.get("node", "local")
        if not isinstance(resource, str) or not isinstance(node, str):
            raise CapacityUnreadableError(f"{what}: an alarm without resource or node: {dict(alarm)!r:.200}")
        raised.append((resource, node))
    # status has no node key, but its listeners name the node (and so does an alarm, if one is raised).
    listeners = status.get("listeners")
    named = (
        [item.get("node") for item in listeners if isinstance(item, Mapping)]
        if isinstance(listeners, list)
        else []
    )
    node = next((name for name in named if isinstance(name, str)), raised[0][1] if raised else "local")
    fds, totals = _section(status, "file_descriptors"), _section(status, "totals")
    return BrokerCapacity(
        source="diagnostics",
        nodes=[node],
        memory_alarm=any(resource == "memory" for resource, _ in raised),
        disk_alarm=any(resource == "disk" for resource, _ in raised),
        alarms=[f"{_ALARM_WORDS.get(resource, resource + ' alarm')} on {on}" for resource, on in raised],
        disk_free_bytes=_count(status.get("disk_free")),
        disk_free_limit_bytes=_count(status.get("disk_free_limit")),
        fd_used=_count(fds.get("total_used")),
        fd_limit=_limit(fds.get("total_limit")),
        queues=_count(totals.get("queue_count")),
    )


def from_management(nodes: Sequence[Mapping[str, Any]], overview: Mapping[str, Any]) -> BrokerCapacity:
    """A reading from the management API's ``GET /api/nodes`` and ``GET /api/overview`` (the whole cluster)."""
    if not isinstance(nodes, list | tuple) or not nodes:
        raise CapacityUnreadableError("GET /api/nodes: expected a non-empty list of nodes")
    entries = [_mapping(entry, "GET /api/nodes: a node") for entry in nodes]
    names = [entry.get("name") for entry in entries]
    if not all(isinstance(name, str) for name in names):
        raise CapacityUnreadableError("GET /api/nodes: a node without a name")
    memory = [f"memory alarm on {entry['name']}" for entry in entries if entry.get("mem_alarm") is True]
    disk = [f"disk alarm on {entry['name']}" for entry in entries if entry.get("disk_free_alarm") is True]
    disk_free, disk_limit = _tightest(
        [(_count(entry.get("disk_free")), _count(entry.get("disk_free_limit"))) for entry in entries],
        lambda free, limit: free - limit,
    )
    fd_used, fd_limit = _tightest(
        [(_count(entry.get("fd_used")), _limit(entry.get("fd_total"))) for entry in entries],
        lambda used, limit: limit - used,
    )
    totals = _section(_mapping(overview, "GET /api/overview"), "object_totals")
    return BrokerCapacity(
        source="management",
        nodes=[str(name) for name in names],
        memory_alarm=bool(memory),
        disk_alarm=bool(disk),
        alarms=memory + disk,
        disk_free_bytes=disk_free,
        disk_free_limit_bytes=disk_limit,
        fd_used=fd_used,
        fd_limit=fd_limit,
        queues=_count(totals.get("queues")),
    )


class CapacityReader:
    """Reads the management API when ``management_url`` is set, else ``diagnostics_command`` when it is
    on PATH and the AMQP URL points at this machine, else nothing (``source`` is None).

    :meth:`read` raises :class:`CapacityUnreadableError`; :meth:`recent` answers None instead, and keeps a
    reading (or a failure, so that a broken source is not asked on every call) for ``max_age_s``.
    """

    @classmethod
    def of(cls, settings: CommonSettings) -> CapacityReader:
        """The reader the operator's settings point at (``HOOKLINE_RABBITMQ_MANAGEMENT_URL``, else
        ``rabbitmq-diagnostics`` for a broker on this machine)."""
        return cls(
            management_url=settings.rabbitmq_management_url,
            diagnostics_command=settings.rabbitmq_diagnostics,
            amqp_url=settings.amqp_url,
        )

    def __init__(
        self,
        *,
        management_url: str | None,
        diagnostics_command: str | None,
        amqp_url: str,
        timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._timeout_s = timeout_s
        self._clock = clock
        self._target: str | None = None  # the URL (credentials stripped) or the command's path: safe to log
        self._auth: tuple[str, str] | None = None
        self._client: httpx.AsyncClient | None = None
        amqp = urlsplit(amqp_url.split(",")[0].strip())  # a cluster: the first node (the local one)
        if management_url:
            parts = urlsplit(management_url)
            self._target = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
            owner = parts if parts.username is not None else amqp  # the broker's user may read it too
            if owner.username is not None:
                self._auth = (unquote(owner.username), unquote(owner.password or ""))
        elif diagnostics_command and amqp.hostname in _LOCAL_HOSTS:
            self._target = shutil.which(diagnostics_command)
        # The CLI boots an Erlang VM: about half a second of a core, every read, on the broker's own
        # machine, where the dispatchers may be too. At the lowest priority it takes only what is idle.
        nice = shutil.which("nice")
        self._lowest_priority: tuple[str, ...] = (nice, "-n", "19") if nice else ()
        self._source: Source | None = (
            "management" if management_url else "diagnostics" if self._target else None
        )
        self._lock = asyncio.Lock()  # concurrent callers of recent() share one read
        self._last: BrokerCapacity | None = None
        self._last_at_s: float | None = None
        self._warned_at_s: float | None = None

    @property
    def source(self) -> Source | None:
        return self._source

    @property
    def target(self) -> str | None:
        """Where readings come from, safe to log."""
        return self._target

    async def __aenter__(self) -> Self:
        if self._source == "management" and self._target is not None:
            self._client = httpx.AsyncClient(base_url=self._target, auth=self._auth, timeout=self._timeout_s)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def read(self) -> BrokerCapacity:
        if self._source is None or self._target is None:
            raise CapacityUnreadableError(
                "no source: no management URL, and no diagnostics command for a local broker"
            )
        if self._source == "management":
            return await self._read_management(self._target)
        return await self._read_diagnostics(self._target)

    async def recent(self, max_age_s: float) -> BrokerCapacity | None:
        """The last reading if younger than ``max_age_s``, else a new one; None without a source or on failure."""
        if self.source is None:
            return None
        async with self._lock:
            now_s = self._clock()
            if self._last_at_s is not None and now_s - self._last_at_s < max_age_s:
                return self._last
            try:
                self._last = await self.read()
            except CapacityUnreadableError as exc:
                self._last = None
                if self._warned_at_s is None or now_s - self._warned_at_s >= _WARN_EVERY_S:
                    self._warned_at_s = now_s
                    log.warning("broker_capacity_unreadable", source=self.source, error=str(exc))
            self._last_at_s = now_s
            return self._last

    async def _read_management(self, url: str) -> BrokerCapacity:
        if self._client is None:
            raise RuntimeError("CapacityReader.read() needs 'async with CapacityReader(...)' first")
        where = f"management API at {url}"
        try:
            async with asyncio.timeout(self._timeout_s):
                answers = []
                for path in ("api/nodes", "api/overview"):
                    response = (await self._client.get(path)).raise_for_status()
                    answers.append(orjson.loads(response.content))
        except TimeoutError:
            raise CapacityUnreadableError(f"{where}: no answer within {self._timeout_s:g}s") from None
        except httpx.HTTPStatusError as exc:
            status = exc.response.status_code
            raise CapacityUnreadableError(f"{where}: HTTP {status} for {exc.request.url.path}") from None
        except httpx.HTTPError as exc:
            raise CapacityUnreadableError(f"{where}: {type(exc).__name__} {str(exc)[:200]}") from None
        except orjson.JSONDecodeError:
            raise CapacityUnreadableError(f"{where}: the answer is not JSON") from None
        return from_management(*answers)

    async def _read_diagnostics(self, path: str) -> BrokerCapacity:
        where = f"{path} -q status"
        try:
            process = await asyncio.create_subprocess_exec(
                *(*self._lowest_priority, path, "-q", "status", "--formatter", "json"),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # a process group of its own, to be killed whole
            )
        except OSError as exc:
            raise CapacityUnreadableError(f"{where}: cannot start: {exc}") from None
        try:
            async with asyncio.timeout(self._timeout_s):
                stdout, stderr = await process.communicate()
        except TimeoutError:
            raise CapacityUnreadableError(f"{where}: no answer within {self._timeout_s:g}s") from None
        finally:
            if process.returncode is None:
                # The CLI is a shell script that starts an Erlang VM: a child left alive would keep the
                # pipes (and so the wait for them) open.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.communicate()  # drains and closes the pipes, and reaps it
        if process.returncode != 0:
            detail = stderr.decode(errors="replace").strip()[-300:]
            raise CapacityUnreadableError(f"{where}: exit status {process.returncode}: {detail}")
        try:
            status = orjson.loads(stdout)
        except orjson.JSONDecodeError:
            raise CapacityUnreadableError(f"{where}: the output is not JSON") from None
        return from_diagnostics(status)
