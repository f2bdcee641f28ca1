"""The audit trail: who changed what, when — every change made through the API.

Each change (an endpoint created, changed, paused, resumed, rotated, verified or deleted; a redrive; a
replay; a resend; a token created, expired or revoked; a quota set; an event type written) appends one
record to the ``hookline.audit`` stream once the change is done (a batch registration puts its records
in one message), naming the actor (``admin``, ``token:<id>`` or ``env:<tenant>``), the action, the
target and what changed — field names and values, never a secret, a header value or an auth
credential. Every ingest replica follows the stream into a
local view (SQLite) that ``GET /v1/audit`` reads; a tenant token sees its own tenant's records.

A record is written after its change succeeded, so that a refused change leaves none; should the broker
refuse the record then (an alarm that began meanwhile, or a resend by hand, which an alarm does not
stop), the change stands and the record is held until the broker takes it
(:mod:`hookline.shared.broker.heldpublishes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import aio_pika
import structlog
from fastapi import APIRouter, Depends, Query, Request
from pydantic import AwareDatetime, TypeAdapter

from hookline.ingest.auth import Caller, Principal
from hookline.ingest.state import ingest_state
from hookline.shared.broker import permissions, topology
from hookline.shared.broker.heldpublishes import HeldPublishes
from hookline.shared.broker.views import RowView, StreamMessage, ViewSchema
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import ErrorDetail, Model
from hookline.shared.runtime.api import ApiError

log = structlog.get_logger(__name__)

#: Fields of an endpoint whose values are never shown in the trail (their names are).
SECRET_FIELDS = frozenset({"secrets", "sealed_headers", "sealed_auth", "headers", "auth", "poll_token_hash"})
_URL_FIELDS = frozenset({"url", "notify_url"})
# Fields that change with every write: not a change anyone made.
_BOOKKEEPING = frozenset(
    {
        "id",
        "created_at",
        "version",
        "updated_at",
        "queue_generation",
        "retired_queues",
        "routed",
        "laned",
        "straight",
    }
)

SCHEMA = ViewSchema(
    version=2,
    statements=[
        # One message of the stream may hold several records (a batch registration): ``seq`` orders them.
        """CREATE TABLE audit (
            offset INTEGER NOT NULL,
            seq INTEGER NOT NULL,
            id TEXT NOT NULL,
            at_s REAL NOT NULL,
            tenant TEXT,
            record BLOB NOT NULL,
            PRIMARY KEY (offset, seq)
        )""",
        "CREATE INDEX audit_by_tenant ON audit (tenant, offset, seq)",
        "CREATE INDEX audit_by_time ON audit (at_s)",
        "CREATE INDEX audit_by_id ON audit (id)",
    ],
)


class AuditRecord(Model):
    id: str
    at: datetime
    actor: str
    action: str
    tenant: str | None
    target: str | None
    changes: dict[str, Any]


class AuditList(Model):
    data: list[AuditRecord]
    next_after: str | None = None


def changes_between(before: Model | None, after: Model | None) -> dict[str, Any]:
    """Each field that differs, ``{"from", "to"}``; a secret field only as ``"changed"``."""
    old = _shown(before.model_dump(mode="json")) if before is not None else {}
    new = _shown(after.model_dump(mode="json")) if after is not None else {}
    changed: dict[str, Any] = {}
    for field in sorted(set(old) | set(new)):
        if field in _BOOKKEEPING or old.get(field) == new.get(field):
            continue
        changed[field] = (
            "changed" if field in SECRET_FIELDS else {"from": old.get(field), "to": new.get(field)}
        )
    return changed


def redact_url(url: str) -> str:
    """A URL as the trail keeps it: scheme, host and path; credentials and query values (a webhook URL's
    secret often lives there) replaced by ``…``."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = (
        ("…@" if parts.username or parts.password else "") + host + (f":{parts.port}" if parts.port else "")
    )
    query = "&".join(f"{name}=…" for name, _ in parse_qsl(parts.query, keep_blank_values=True))
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def _shown(fields: dict[str, Any]) -> dict[str, Any]:
    return {
        name: redact_url(value) if name in _URL_FIELDS and isinstance(value, str) else value
        for name, value in fields.items()
    }


@dataclass(frozen=True)
class AuditTrail:
    """Where the routes append their records: the ``hookline.audit`` stream, as the ingest's broker
    user (the followers keep only records a trusted writer wrote)."""

    records: HeldPublishes
    user: str

    async def record(
        self,
        caller: Principal,
        action: str,
        *,
        tenant: str | None,
        target: str | None,
        changes: dict[str, Any] | None = None,
    ) -> None:
        entry = AuditRecord(
            id=new_id("aud"),
            at=datetime.now(UTC),
            actor=caller.actor,
            action=action,
            tenant=tenant,
            target=target,
            changes=changes or {},
        )
        await self._publish(entry.id, entry.model_dump_json().encode(), action=action, target=target)

    async def record_many(self, caller: Principal, action: str, targets: list[AuditTarget]) -> None:
        """One record per target, in one message (a batch registration: one publish, not 500); read
        by this version on (an older one skips it as unreadable)."""
        now = datetime.now(UTC)
        entries = [
            AuditRecord(
                id=new_id("aud"),
                at=now,
                actor=caller.actor,
                action=action,
                tenant=target.tenant,
                target=target.target,
                changes=target.changes,
            )
            for target in targets
        ]
        if entries:
            body = _entries.dump_json(entries)
            await self._publish(entries[0].id, body, action=action, target=f"{len(entries)} targets")

    async def _publish(self, message_id: str, body: bytes, *, action: str, target: str | None) -> None:
        message = aio_pika.Message(
            body,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=message_id,
            user_id=self.user,
        )
        if not await self.records.publish(message, exchange="", routing_key=topology.AUDIT_LOG, what="audit"):
            log.warning("audit_record_held", action=action, target=target)


@dataclass(frozen=True, slots=True)
class AuditTarget:
    """What one record of :meth:`AuditTrail.record_many` is about."""

    tenant: str | None
    target: str | None
    changes: dict[str, Any]


_entries: TypeAdapter[list[AuditRecord]] = TypeAdapter(list[AuditRecord])


async def _trail(request: Request) -> AuditTrail:
    return ingest_state(request).trail


async def _view(request: Request) -> RowView:
    return ingest_state(request).audit


#: A route's audit trail.
Trail = Annotated[AuditTrail, Depends(_trail)]


def _rows(offset: int, message: StreamMessage) -> list[tuple[Any, ...]]:
    if not permissions.trusted_writer(message.user_id):
        log.error("audit_record_refused", offset=offset, user=message.user_id)
        return []
    try:
        if message.body.startswith(b"["):  # several (record_many)
            entries = [(e, e.model_dump_json().encode()) for e in _entries.validate_json(message.body)]
        else:
            entries = [(AuditRecord.model_validate_json(message.body), message.body)]
    except ValueError:
        log.error("audit_record_unreadable", offset=offset)
        return []
    return [(offset, seq, e.id, e.at.timestamp(), e.tenant, body) for seq, (e, body) in enumerate(entries)]


def view(path: Path | None, *, vhost: str) -> RowView:
    return RowView(
        path.with_suffix(".audit.sqlite") if path else None,
        schema=SCHEMA,
        identity=f"{vhost}/{topology.AUDIT_LOG}",
        insert="INSERT OR REPLACE INTO audit VALUES (?, ?, ?, ?, ?, ?)",
        derive=_rows,
    )


router = APIRouter(prefix="/v1/audit", tags=["audit"])


@router.get("", response_model=AuditList)
async def list_audit(
    audit: Annotated[RowView, Depends(_view)],
    caller: Caller,
    tenant: str | None = None,
    since: AwareDatetime | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[str | None, Query(description="the page after this record id")] = None,
    order: Annotated[Literal["asc", "desc"], Query(description="asc: oldest first (follow it)")] = "asc",
) -> AuditList:
    scope = caller.scope(tenant)
    conditions: list[str] = ["at_s >= ?"]
    values: list[object] = [since.timestamp() if since is not None else 0.0]
    if scope is not None:
        conditions.append("tenant = ?")
        values.append(scope)
    if after is not None:
        found = await audit.read(
            lambda db: db.execute("SELECT offset, seq FROM audit WHERE id = ?", (after,)).fetchone()
        )
        if found is None:
            raise ApiError(
                422,
                "invalid_fields",
                "invalid value for: after",
                [ErrorDetail(field="after", message="no such audit record")],
            )
        conditions.append("(offset, seq) > (?, ?)" if order == "asc" else "(offset, seq) < (?, ?)")
        values.extend(found)
    # Only the fixed conditions above are joined in; every value is a placeholder.
    sql = (
        f"SELECT record FROM audit WHERE {' AND '.join(conditions)} "  # noqa: S608
        f"ORDER BY offset {order}, seq {order} LIMIT ?"
    )
    rows = await audit.read(lambda db: db.execute(sql, (*values, limit + 1)).fetchall())
    page = [AuditRecord.model_validate_json(row[0]) for row in rows[:limit]]
    return AuditList(data=page, next_after=page[-1].id if len(rows) > limit else None)


async def expire(audit: RowView, *, now_s: float) -> int:
    """Rows older than the stream keeps (``topology.AUDIT_MAX_AGE_S``) leave the view too."""
    cutoff_s = now_s - topology.AUDIT_MAX_AGE_S
    return await audit.store.write(
        lambda db: db.execute("DELETE FROM audit WHERE at_s < ?", (cutoff_s,)).rowcount
    )
