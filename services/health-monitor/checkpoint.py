"""The monitor's statistics on local disk, so that a restart resumes the telemetry log instead of
replaying its last 24 h.

A checkpoint is the whole :class:`~hookline.health_monitor.health.Health` (windows, breakers, events
awaiting a retry, heartbeats, the last command version) turned into bytes by :func:`dump`, and kept by
:class:`CheckpointStore` in one SQLite row together with the offset of the last telemetry record it
includes and the identity of the stream that offset belongs to. A restarted monitor loads it with
:func:`load` and resumes at offset + 1. A checkpoint it cannot use (missing, another format, another
stream) means rebuilding from the stream, as without one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Self, TypeVar

import orjson
import structlog

from hookline.health_monitor.breaker import Breaker
from hookline.health_monitor.health import EndpointHealth, Health, HealthPolicy, TypeHealth
from hookline.health_monitor.sketch import LatencySketch
from hookline.health_monitor.stats import RollingStats, Stats
from hookline.shared.control import BreakerCommand, BreakerState
from hookline.shared.statefiles import StateFile, StateFileReplacedError
from hookline.shared.telemetry import Heartbeat

__all__ = ["FORMAT_VERSION", "CheckpointError", "CheckpointStore", "dump", "load"]

log = structlog.get_logger(__name__)

#: Incremented whenever what :func:`dump` writes changes meaning; other versions are not loaded.
FORMAT_VERSION = 1
#: The counters of a :class:`Stats`, in the order a stored slot lists them (the sketch is stored apart).
_COUNTERS = tuple(f.name for f in dataclasses.fields(Stats) if f.name != "sketch")

T = TypeVar("T")


class CheckpointError(Exception):
    """The checkpoint cannot be used (another format or layout, or damaged): rebuild from the stream."""


# --- serialisation ------------------------------------------------------------------------------


def dump(health: Health) -> bytes:
    """Everything a restarted monitor needs; queue depths are left out (they are polled again)."""
    return orjson.dumps(
        {
            "format": FORMAT_VERSION,
            "layout": _layout(),
            # Later commands must keep a higher version than any a dispatcher has already applied.
            "last_version": health._last_version,
            "dispatchers": [beat.model_dump() for beat in health.dispatchers.values()],
            "endpoints": {endpoint_id: _dump_endpoint(e) for endpoint_id, e in health.endpoints.items()},
            "types": {event_type: _dump_type(t) for event_type, t in health.types.items()},
        }
    )


def load(data: bytes, *, policy: HealthPolicy) -> Health:
    """The :class:`Health` that :func:`dump` wrote.

    Raises :class:`CheckpointError` for another format version, statistics laid out differently (a
    counter added, a window resized) or damaged data.
    """
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise CheckpointError(f"not a checkpoint: {exc}") from exc
    version = document.get("format") if isinstance(document, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint format {version!r}; this monitor reads format {FORMAT_VERSION}")
    if document.get("layout") != _layout():
        raise CheckpointError("checkpoint written with other statistics counters or windows")
    try:
        return _load_health(document, policy)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # pydantic's errors are ValueErrors
        raise CheckpointError(f"damaged checkpoint ({type(exc).__name__})") from exc


def _layout() -> dict[str, Any]:
    """What a stored slot means: the counters' order and each window's geometry."""
    endpoint, types = EndpointHealth(), TypeHealth()
    return {
        "counters": list(_COUNTERS),
        "endpoint": [_geometry(endpoint.day), _geometry(endpoint.hour), _geometry(endpoint.recent)],
        "type": [_geometry(types.day), _geometry(types.recent)],
    }


def _geometry(window: RollingStats) -> list[int]:
    return [window.window_s, window.slot_s]


def _dump_endpoint(health: EndpointHealth) -> dict[str, Any]:
    return {
        "day": _dump_window(health.day),
        "hour": _dump_window(health.hour),
        "recent": _dump_window(health.recent),
        "breaker": health.breaker,  # a dataclass: orjson writes its fields, the state as its value
        "command": health.command.model_dump() if health.command is not None else None,
        "retrying": health.retrying,  # in order of last record, which prune() relies on
        "last_attempt_at_s": health.last_attempt_at_s,
        "probe_asked_at_s": health.probe_asked_at_s,
    }


def _dump_type(health: TypeHealth) -> dict[str, Any]:
    return {
        "day": _dump_window(health.day),
        "recent": _dump_window(health.recent),
        "last_attempt_at_s": health.last_attempt_at_s,
    }


def _dump_window(window: RollingStats) -> list[list[Any]]:
    # One row per slot: [slot, [counters…], [bucket indices…], [bucket counts…], sample count].
    # RollingStats keeps its slots private; this module is the one place that reads them whole.
    return [
        [
            slot,
            [getattr(stats, name) for name in _COUNTERS],
            list(stats.sketch.bins),
            list(stats.sketch.bins.values()),
            stats.sketch.count,
        ]
        for slot, stats in window._slots.items()
    ]


def _load_health(document: dict[str, Any], policy: HealthPolicy) -> Health:
    health = Health(policy)
    health._last_version = int(document["last_version"])
    for fields in document["dispatchers"]:
        beat = Heartbeat.model_validate(fields)
        health.dispatchers[beat.dispatcher_id] = beat
    for endpoint_id, fields in document["endpoints"].items():
        health.endpoints[endpoint_id] = _load_endpoint(fields)
    for event_type, fields in document["types"].items():
        types = health.types[event_type] = TypeHealth(last_attempt_at_s=fields["last_attempt_at_s"])
        _load_window(types.day, fields["day"])
        _load_window(types.recent, fields["recent"])
    return health


def _load_endpoint(fields: dict[str, Any]) -> EndpointHealth:
    breaker = fields["breaker"]
    command = fields["command"]
    health = EndpointHealth(
        breaker=Breaker(**(breaker | {"state": BreakerState(breaker["state"])})),
        command=BreakerCommand.model_validate(command) if command is not None else None,
        retrying={event_id: (first_s, last_s) for event_id, (first_s, last_s) in fields["retrying"].items()},
        last_attempt_at_s=fields["last_attempt_at_s"],
        probe_asked_at_s=fields["probe_asked_at_s"],
    )
    _load_window(health.day, fields["day"])
    _load_window(health.hour, fields["hour"])
    _load_window(health.recent, fields["recent"])
    return health


def _load_window(window: RollingStats, rows: list[list[Any]]) -> None:
    for slot, counters, indices, counts, count in rows:
        sketch = LatencySketch()
        sketch.bins = dict(zip(indices, counts, strict=True))
        sketch.count = count
        window._slots[slot] = Stats(sketch, **dict(zip(_COUNTERS, counters, strict=True)))


# --- storage ------------------------------------------------------------------------------------

# One row: a checkpoint replaces the last one, and its data and offset are written in one transaction.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoint (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    identity TEXT NOT NULL,
    stream_offset INTEGER NOT NULL,
    data BLOB NOT NULL
)
"""
_SAVE = """
INSERT INTO checkpoint (id, identity, stream_offset, data) VALUES (1, ?, ?, ?)
ON CONFLICT (id) DO UPDATE
SET identity = excluded.identity, stream_offset = excluded.stream_offset, data = excluded.data
"""
_READ = "SELECT identity, stream_offset, data FROM checkpoint WHERE id = 1"


class CheckpointStore:
    """The last checkpoint, in one SQLite file (``path=None``: in memory, for tests).

    Use it as ``async with CheckpointStore(path) as store``. SQLite runs on one worker thread of the
    store's own, never on the event loop; one thread also keeps the writes in the order they were asked.
    A file found damaged is set aside (:mod:`hookline.shared.statefiles`): at start the monitor then
    rebuilds its statistics from the telemetry log; in use, the next save writes the whole checkpoint
    into the fresh file.
    """

    def __init__(self, path: Path | None) -> None:
        self._file = StateFile(path, prepare=_prepare)
        self._executor: ThreadPoolExecutor | None = None

    async def __aenter__(self) -> Self:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        try:
            await self._run(self._file.open)
        except BaseException:
            self._executor.shutdown(wait=False)
            self._executor = None
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        executor, self._executor = self._executor, None
        if executor is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(executor, self._file.close)
        except BaseException:
            executor.shutdown(wait=False)  # cancelled while closing: the thread ends after close()
            raise
        executor.shutdown(wait=True)  # the thread is idle now: this returns at once

    async def save(self, data: bytes, *, offset: int, identity: str) -> None:
        """Replace the checkpoint with ``data``, which includes every record of the stream ``identity``
        up to ``offset``."""
        save = partial(self._file.run, partial(_save, data=data, offset=offset, identity=identity))
        try:
            await self._run(save)
        except StateFileReplacedError:
            await self._run(save)  # the whole checkpoint, into the fresh file

    async def read(self, identity: str) -> tuple[bytes, int] | None:
        """The checkpoint and its offset, or None when there is none for the stream ``identity``."""
        try:
            row = await self._run(partial(self._file.run, _read))
        except StateFileReplacedError:
            return None  # set aside: rebuilt from the stream, as without a checkpoint
        if row is None:
            return None
        stored_identity, offset, data = row
        if stored_identity != identity:
            # Another vhost or stream, or the stream was recreated: its offsets mean nothing here.
            log.warning(
                "checkpoint_ignored", identity=identity, stored_identity=stored_identity, offset=offset
            )
            return None
        return data, offset

    def _opened(self) -> sqlite3.Connection:
        if self._executor is None:
            raise RuntimeError("CheckpointStore is used inside `async with` only")
        return self._file.connection

    async def _run(self, call: Callable[[], T]) -> T:
        if self._executor is None:
            raise RuntimeError("CheckpointStore is used inside `async with` only")
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)


# These run on the store's thread; the connection is created there and never leaves it.


def _prepare(connection: sqlite3.Connection) -> None:
    connection.execute(_SCHEMA)


def _save(connection: sqlite3.Connection, *, data: bytes, offset: int, identity: str) -> None:
    with connection:
        connection.execute(_SAVE, (identity, offset, data))


def _read(connection: sqlite3.Connection) -> tuple[str, int, bytes] | None:
    row: tuple[str, int, bytes] | None = connection.execute(_READ).fetchone()
    return row
