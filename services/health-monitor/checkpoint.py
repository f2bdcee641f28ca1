"""The monitor's statistics on local disk, so that a restart resumes the telemetry log instead of
replaying its last 24 h.

A checkpoint is the whole :class:`~hookline.health_monitor.health.Health` (windows, breakers, events
awaiting a retry, heartbeats, the last command version) turned into bytes by :func:`dump`, and kept by
:class:`CheckpointStore` in one SQLite row together with the offset of the last telemetry record it
includes and the identity of the stream that offset belongs to. A restarted monitor loads it with
:func:`load` and resumes at offset + 1. A checkpoint it cannot use (missing, another format, another
stream) means rebuilding from the stream, as without one.

Beside it, in a row of its own, the alert book (:func:`dump_alerts`): which alerts fire, as the world
was told, and the alerts and notifications the broker has not taken yet. It is not derived from any
stream and changes at other moments than the statistics, so it is saved whenever it changes, before what
it records is sent: a restarted monitor neither fires again what it had fired nor forgets to resolve
what ended while it was down, nor loses what it had yet to send.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, Self, TypeVar

import aio_pika
import orjson
import structlog

from hookline.health_monitor.alerts import Alert, AlertKey
from hookline.health_monitor.breaker import Breaker
from hookline.health_monitor.health import EndpointHealth, Health, HealthPolicy, TypeHealth
from hookline.health_monitor.sketch import LatencySketch
from hookline.health_monitor.stats import RollingStats, Stats
from hookline.shared.contracts.control import BreakerCommand, BreakerState
from hookline.shared.contracts.telemetry import Heartbeat
from hookline.shared.state.statefiles import StateFile, StateFileReplacedError

__all__ = [
    "FORMAT_VERSION", "AlertState", "CheckpointError", "CheckpointStore", "Unsent", "dump", "dump_alerts",
    "load", "load_alerts",
]  # fmt: skip

log = structlog.get_logger(__name__)

#: Incremented whenever what :func:`dump` writes changes meaning; other versions are not loaded.
FORMAT_VERSION = 1
#: Incremented whenever what :func:`dump_alerts` writes changes meaning.
ALERTS_FORMAT_VERSION = 1
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
    # The buckets as (index, count) pairs of the non-empty ones, whatever the sketch keeps in memory:
    # the format written before the dense sketches, so either version reads the other's checkpoints.
    rows = []
    for slot, stats in window._slots.items():
        bins = stats.sketch.bins
        counters = [getattr(stats, name) for name in _COUNTERS]
        rows.append([slot, counters, list(bins), list(bins.values()), stats.sketch.count])
    return rows


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
        sketch = LatencySketch.of(dict(zip(indices, counts, strict=True)))
        if sketch.count != count:
            raise ValueError(f"a sketch of {count} samples whose buckets hold {sketch.count}")
        window._slots[slot] = Stats(sketch, **dict(zip(_COUNTERS, counters, strict=True)))


# --- the alert book -----------------------------------------------------------------------------

#: A message the broker has not taken yet: (message, exchange, routing key).
Unsent = tuple[aio_pika.Message, str, str]


@dataclasses.dataclass(frozen=True)
class AlertState:
    """The alerts firing (as told) and the messages about them still to send, in order."""

    firing: dict[AlertKey, Alert]
    unsent: list[Unsent]


def dump_alerts(firing: Mapping[AlertKey, Alert], unsent: Iterable[Unsent]) -> bytes:
    return orjson.dumps(
        {
            "format": ALERTS_FORMAT_VERSION,
            "firing": [[a.name, a.endpoint_id, a.tenant, a.detail] for a in firing.values()],
            "unsent": [_dump_message(*item) for item in unsent],
        }
    )


def load_alerts(data: bytes) -> AlertState:
    """What :func:`dump_alerts` wrote; :class:`CheckpointError` for another format or damaged data."""
    try:
        document = orjson.loads(data)
        if not isinstance(document, dict) or document.get("format") != ALERTS_FORMAT_VERSION:
            raise CheckpointError(f"alert book format {document.get('format')!r}")
        alerts = [
            Alert(str(name), endpoint_id, tenant, str(detail))
            for name, endpoint_id, tenant, detail in document["firing"]
        ]
        return AlertState(
            {alert.key: alert for alert in alerts}, [_load_message(m) for m in document["unsent"]]
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"damaged alert book ({type(exc).__name__})") from exc


def _dump_message(message: aio_pika.Message, exchange: str, routing_key: str) -> dict[str, Any]:
    return {
        "exchange": exchange,
        "routing_key": routing_key,
        "body": message.body.decode(),  # alerts and notifications are JSON
        "content_type": message.content_type,
        "persistent": message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT,
        "message_id": message.message_id,
        "timestamp": message.timestamp.isoformat() if message.timestamp else None,
        "type": message.type,
    }


def _load_message(fields: dict[str, Any]) -> Unsent:
    message = aio_pika.Message(
        fields["body"].encode(),
        content_type=fields["content_type"],
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT if fields["persistent"] else None,
        message_id=fields["message_id"],
        timestamp=datetime.fromisoformat(fields["timestamp"]) if fields["timestamp"] else None,
        type=fields["type"],
    )
    return message, str(fields["exchange"]), str(fields["routing_key"])


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
# The alert book: a row of its own (a file written before it existed gets the table at open).
_ALERTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS alert_book (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    identity TEXT NOT NULL,
    data BLOB NOT NULL
)
"""
_SAVE_ALERTS = """
INSERT INTO alert_book (id, identity, data) VALUES (1, ?, ?)
ON CONFLICT (id) DO UPDATE SET identity = excluded.identity, data = excluded.data
"""
_READ_ALERTS = "SELECT identity, data FROM alert_book WHERE id = 1"


class CheckpointStore:
    """The last checkpoint, in one SQLite file (``path=None``: in memory, for tests).

    Use it as ``async with CheckpointStore(path) as store``. SQLite runs on one worker thread of the
    store's own, never on the event loop; one thread also keeps the writes in the order they were asked.
    A file found damaged is set aside (:mod:`hookline.shared.state.statefiles`): at start the monitor then
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

    async def save_alerts(self, data: bytes, *, identity: str) -> None:
        """Replace the alert book with ``data``, the book of the monitors of ``identity`` (a vhost)."""
        save = partial(self._file.run, partial(_save_alerts, data=data, identity=identity))
        try:
            await self._run(save)
        except StateFileReplacedError:
            await self._run(save)  # into the fresh file (its checkpoint follows within 30 s)

    async def read_alerts(self, identity: str) -> bytes | None:
        """The alert book of ``identity``; None when there is none (or the file was set aside)."""
        try:
            row = await self._run(partial(self._file.run, _read_alerts))
        except StateFileReplacedError:
            return None
        if row is None or row[0] != identity:
            return None
        return row[1]

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
    connection.execute(_ALERTS_SCHEMA)


def _save(connection: sqlite3.Connection, *, data: bytes, offset: int, identity: str) -> None:
    with connection:
        connection.execute(_SAVE, (identity, offset, data))


def _read(connection: sqlite3.Connection) -> tuple[str, int, bytes] | None:
    row: tuple[str, int, bytes] | None = connection.execute(_READ).fetchone()
    return row


def _save_alerts(connection: sqlite3.Connection, *, data: bytes, identity: str) -> None:
    connection.execute(_SAVE_ALERTS, (identity, data))


def _read_alerts(connection: sqlite3.Connection) -> tuple[str, bytes] | None:
    row: tuple[str, bytes] | None = connection.execute(_READ_ALERTS).fetchone()
    return row
