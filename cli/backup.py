"""Backups of the endpoint change log: ``hookline export`` and ``hookline import``.

The change log (the stream ``hookline.endpoints``) is the only copy of every endpoint (its signing
secrets, header values and credentials sealed), event type, tenant token and quota. An export is the
state its records add up to as of one offset of the stream — each service folds the same records the
same way, so every prefix of the log is a consistent state — one JSON object per line: a header naming
the format, its version and that offset, then one line per endpoint, event type, token and quota.
Sealed values are written exactly as stored: restoring needs the same ``HOOKLINE_SECRET_KEY``, and a
backup holds no secret in clear.

An import writes that state into a change log that holds nothing else: the core topology declared as
the ingest declares it, then for each endpoint its exchanges, queue and bindings provisioned as the
ingest provisions a new one, then its record. What the log already holds as the backup has it is left
alone (an import retried after a failure goes on where it stopped); anything else there — another
endpoint, a different version of one — refuses the import unless it is forced, which writes the
backup's state over it (and deletes nothing).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Literal

import structlog
from pydantic import AwareDatetime, Field, TypeAdapter, ValidationError

from hookline.shared import __version__
from hookline.shared.broker import placement, topology
from hookline.shared.broker.amqp import Broker, Publisher, QueueProbe
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import (
    EndpointUpserted,
    EventTypeInfo,
    EventTypeUpserted,
    Model,
    StoredEndpoint,
    StoredToken,
    Tenant,
    TenantQuota,
    error_summary,
)
from hookline.shared.outbound.sealing import SealedSecretError, Sealer
from hookline.shared.runtime.settings import CommonSettings
from hookline.shared.runtime.supervision import Supervisor
from hookline.shared.state import registry

log = structlog.get_logger(__name__)

FORMAT: Literal["hookline-backup"] = "hookline-backup"
FORMAT_VERSION = 1
#: Endpoints provisioned and written at once (each a few broker round trips).
RESTORE_WINDOW = 32


class BackupError(Exception):
    """A backup that cannot be read, or an import refused; the message says why and what to do."""


class Header(Model):
    format: Literal["hookline-backup"] = FORMAT
    version: int = FORMAT_VERSION
    stream: str = topology.ENDPOINT_LOG
    offset: int | None = Field(description="the last record of the stream the state includes (None: empty)")
    vhost: str
    exported_at: AwareDatetime
    hookline_version: str
    counts: dict[str, int]


class EndpointLine(Model):
    kind: Literal["endpoint"] = "endpoint"
    endpoint: StoredEndpoint


class EventTypeLine(Model):
    kind: Literal["event_type"] = "event_type"
    event_type: EventTypeInfo


class TokenLine(Model):
    kind: Literal["token"] = "token"
    token: StoredToken


class QuotaLine(Model):
    kind: Literal["quota"] = "quota"
    tenant: Tenant
    quota: TenantQuota


_line: TypeAdapter[EndpointLine | EventTypeLine | TokenLine | QuotaLine] = TypeAdapter(
    Annotated[EndpointLine | EventTypeLine | TokenLine | QuotaLine, Field(discriminator="kind")]
)


@dataclass(frozen=True)
class Snapshot:
    """The change log's state: what a backup holds, and what an import compares it with."""

    endpoints: list[StoredEndpoint] = field(default_factory=list)
    event_types: list[EventTypeInfo] = field(default_factory=list)
    tokens: list[StoredToken] = field(default_factory=list)
    quotas: dict[str, TenantQuota] = field(default_factory=dict)
    offset: int | None = None

    @classmethod
    def of(cls, change_log: registry.ChangeLog) -> Snapshot:
        """The state as of the last record applied (no await here: one offset, whatever arrives)."""
        return cls(
            endpoints=sorted(change_log.registry.rows.all(), key=lambda endpoint: endpoint.id),
            event_types=change_log.catalog.all(),
            tokens=sorted(change_log.tenants.tokens(), key=lambda token: token.id),
            quotas=dict(sorted(change_log.tenants.quotas().items())),
            offset=change_log.applied_offset,
        )

    def counts(self) -> dict[str, int]:
        return {
            "endpoints": len(self.endpoints),
            "event_types": len(self.event_types),
            "tokens": len(self.tokens),
            "quotas": len(self.quotas),
        }

    def lines(self, *, vhost: str, now: datetime) -> Iterator[bytes]:
        return self._lines(self.endpoints, self.counts(), vhost=vhost, now=now)

    def _lines(
        self, endpoints: Iterable[StoredEndpoint], counts: dict[str, int], *, vhost: str, now: datetime
    ) -> Iterator[bytes]:
        header = Header(
            offset=self.offset, vhost=vhost, exported_at=now, hookline_version=__version__, counts=counts
        )
        yield header.model_dump_json().encode()
        for endpoint in endpoints:
            yield EndpointLine(endpoint=endpoint).model_dump_json().encode()
        for event_type in self.event_types:
            yield EventTypeLine(event_type=event_type).model_dump_json().encode()
        for token in self.tokens:
            yield TokenLine(token=token).model_dump_json().encode()
        for tenant, quota in self.quotas.items():
            yield QuotaLine(tenant=tenant, quota=quota).model_dump_json().encode()


@dataclass(frozen=True)
class Export:
    """A backup as it is written: the state as of one offset of the log, its endpoints read back one at a
    time, in id order, from the export's own registry file (a million of them parsed at once took about
    3 GiB); the rest (event types, tokens, quotas) is small and held."""

    vhost: str
    endpoints: registry.EndpointRegistry
    rest: Snapshot

    def counts(self) -> dict[str, int]:
        return {**self.rest.counts(), "endpoints": len(self.endpoints)}

    def lines(self, *, now: datetime) -> Iterator[bytes]:
        return self.rest._lines(self.endpoints.rows.every(), self.counts(), vhost=self.vhost, now=now)


def parse(lines: Iterable[bytes]) -> tuple[Header, Snapshot]:
    """A backup file's header and state; :class:`BackupError` names the first line that is wrong."""
    header: Header | None = None
    snapshot = Snapshot()
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            if header is None:
                header = _header(text)
                snapshot = Snapshot(offset=header.offset)
                continue
            line = _line.validate_json(text)
        except ValidationError as exc:
            raise BackupError(f"line {number}: {error_summary(exc)}") from None
        if isinstance(line, EndpointLine):
            snapshot.endpoints.append(line.endpoint)
        elif isinstance(line, EventTypeLine):
            snapshot.event_types.append(line.event_type)
        elif isinstance(line, TokenLine):
            snapshot.tokens.append(line.token)
        else:
            snapshot.quotas[line.tenant] = line.quota
    if header is None:
        raise BackupError("empty file: not a hookline backup")
    if snapshot.counts() != header.counts:
        raise BackupError(f"truncated: the header counts {header.counts}, the file holds {snapshot.counts()}")
    return header, snapshot


def _header(text: bytes) -> Header:
    header = Header.model_validate_json(text)
    if header.version != FORMAT_VERSION:
        raise BackupError(
            f"format version {header.version}: this hookline ({__version__}) reads version {FORMAT_VERSION}"
        )
    return header


def restored(endpoint: StoredEndpoint) -> StoredEndpoint:
    """An endpoint as an import writes it: its queues of the old broker are gone (none to drain), and
    it is delivered through its lane (a queue of its own only if its definition needs one), or, ordered,
    from its queue of its own bound to ``events`` (``straight``)."""
    return endpoint.model_copy(
        update={
            "retired_queues": [],
            "routed": True,
            "laned": not endpoint.ordered,
            "straight": endpoint.ordered,
            "lane_fence": None,
            "left_lane_at": None,
        }
    )


def key_problem(backup: Snapshot, sealer: Sealer) -> str | None:
    """Why the services could not sign with the backup's secrets under this key (None: they can): checked
    before anything is written, since a restored system whose secrets do not open delivers nothing."""
    for endpoint in backup.endpoints:
        for secret in endpoint.secrets:
            try:
                sealer.open(secret.value)
            except SealedSecretError as exc:
                return f"endpoint {endpoint.id}: {exc}; give the key the backup's secrets were sealed with"
    return None


@dataclass(frozen=True)
class Plan:
    """What an import writes, and what in the log stands in its way (``conflicts``)."""

    to_write: Snapshot
    already: int  # in the log as the backup has it: left alone
    conflicts: list[str]


def plan(backup: Snapshot, current: Snapshot) -> Plan:
    """Compare the backup with the log's state. Versions are not compared: the log numbers its own."""
    conflicts: list[str] = []
    already = 0

    def needed(kind: str, key: str, wanted: Model, found: Model | None) -> bool:
        nonlocal already
        if found is None:
            return True
        if found.model_dump(exclude={"version"}) == wanted.model_dump(exclude={"version"}):
            already += 1
            return False
        conflicts.append(f"{kind} {key} differs from the backup's")
        return True

    endpoints = {e.id: e for e in current.endpoints}
    event_types = {t.name: t for t in current.event_types}
    tokens = {t.id: t for t in current.tokens}
    to_write = Snapshot(
        endpoints=[
            restored(e)
            for e in backup.endpoints
            if needed("endpoint", e.id, restored(e), endpoints.get(e.id))
        ],
        event_types=[
            t for t in backup.event_types if needed("event type", t.name, t, event_types.get(t.name))
        ],
        tokens=[t for t in backup.tokens if needed("token", t.id, t, tokens.get(t.id))],
        quotas={
            tenant: quota
            for tenant, quota in backup.quotas.items()
            if needed("quota of", tenant, quota, current.quotas.get(tenant))
        },
    )
    in_backup = (
        {("endpoint", e.id) for e in backup.endpoints}
        | {("event type", t.name) for t in backup.event_types}
        | {("token", t.id) for t in backup.tokens}
        | {("quota of", tenant) for tenant in backup.quotas}
    )
    in_log = (
        [("endpoint", e.id) for e in current.endpoints]
        + [("event type", t.name) for t in current.event_types]
        + [("token", t.id) for t in current.tokens]
        + [("quota of", tenant) for tenant in current.quotas]
    )
    conflicts += [
        f"{kind} {key} is not in the backup" for kind, key in in_log if (kind, key) not in in_backup
    ]
    return Plan(to_write, already, conflicts)


# --- I/O ------------------------------------------------------------------------------------------


@asynccontextmanager
async def _following(
    broker: Broker, timeout_s: float, into: registry.EndpointRegistry | None = None
) -> AsyncIterator[registry.ChangeLog]:
    """The change log read up to now (into ``into``, else a registry in memory), and followed while the
    block runs (its writes are read back)."""
    async with QueueProbe(broker) as probe:
        if await probe.find(topology.ENDPOINT_LOG) is None:
            raise BackupError(f"no change log ({topology.ENDPOINT_LOG}) in vhost {broker.vhost!r}")
    publisher = Publisher(broker)
    supervisor = Supervisor()
    try:
        yield await registry.follow(
            broker,
            publisher,
            supervisor,
            registry.EndpointRegistry() if into is None else into,
            sync_timeout_s=timeout_s,
        )
    finally:
        await supervisor.stop()
        await publisher.close()


def _broker(settings: CommonSettings) -> Broker:
    return Broker(settings.amqp_url, name="hookline-backup", connect_timeout_s=settings.connect_timeout_s)


@asynccontextmanager
async def exported(settings: CommonSettings) -> AsyncIterator[Export]:
    """The change log's state now, read into a registry file of the export's own (removed afterwards),
    for as long as the block writes it out."""
    with tempfile.TemporaryDirectory(prefix="hookline-export-") as work:
        async with (
            _broker(settings) as broker,
            registry.kept_at(Path(work) / "registry.sqlite", vhost=broker.vhost) as kept,
        ):
            async with _following(broker, settings.connect_timeout_s, kept) as change_log:
                pass
            # Taken once the follower has stopped: the file and the rest are the log up to one offset.
            rest = Snapshot(
                event_types=change_log.catalog.all(),
                tokens=sorted(change_log.tenants.tokens(), key=lambda token: token.id),
                quotas=dict(sorted(change_log.tenants.quotas().items())),
                offset=change_log.applied_offset,
            )
            yield Export(broker.vhost, kept, rest)


async def restore(settings: CommonSettings, backup: Snapshot, *, force: bool) -> Plan:
    """Write ``backup`` into the broker's change log (see the module's docstring); the plan it followed.
    Raises :class:`BackupError` when ``HOOKLINE_SECRET_KEY`` does not open the backup's secrets, or the
    log holds other things and ``force`` is not given."""
    timeout_s = settings.connect_timeout_s
    key = settings.secret_key.get_secret_value() if settings.secret_key else None
    if (problem := key_problem(backup, Sealer(key))) is not None:
        raise BackupError(problem)
    async with _broker(settings) as broker:
        await topology.declare(broker, settings.retention)
        async with _following(broker, timeout_s) as change_log:
            steps = plan(backup, Snapshot.of(change_log))
            if steps.conflicts and not force:
                shown = "; ".join(steps.conflicts[:5]) + ("; …" if len(steps.conflicts) > 5 else "")
                raise BackupError(
                    f"the change log of vhost {broker.vhost!r} holds other things ({len(steps.conflicts)}: "
                    f"{shown}); import into an empty vhost, or give --force to write the backup over them"
                )
            await _write(broker, change_log, steps.to_write, timeout_s=timeout_s)
    log.info("backup_imported", **steps.to_write.counts(), already=steps.already)
    return steps


async def _write(
    broker: Broker, change_log: registry.ChangeLog, state: Snapshot, *, timeout_s: float
) -> None:
    """Types, tokens and quotas first (the ingest checks endpoints against them), then the endpoints."""
    for event_type in state.event_types:
        record = EventTypeUpserted(change_id=new_id("chg"), at=datetime.now(UTC), event_type=event_type)
        await change_log.write_event_type(record, timeout_s=timeout_s)
    for token in state.tokens:
        await change_log.write_token(token, timeout_s=timeout_s)
    for tenant, quota in state.quotas.items():
        await change_log.write_quota(tenant, quota, timeout_s=timeout_s)
    for start in range(0, len(state.endpoints), RESTORE_WINDOW):
        window = state.endpoints[start : start + RESTORE_WINDOW]
        await asyncio.gather(*(_endpoint(broker, change_log, e, timeout_s=timeout_s) for e in window))


async def _endpoint(
    broker: Broker, change_log: registry.ChangeLog, endpoint: StoredEndpoint, *, timeout_s: float
) -> None:
    """As the ingest registers one: its topology first, so its record never names a missing queue."""
    async with broker.channel() as admin:
        await topology.provision(admin, endpoint, isolated=placement.structural(endpoint) is not None)
    record = EndpointUpserted(change_id=new_id("chg"), at=datetime.now(UTC), endpoint=endpoint)
    await change_log.write(record, timeout_s=timeout_s)
