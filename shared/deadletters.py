"""Dead letters: an event that will not be delivered, kept with why, in the stream ``hookline.dead-letters``.

The body is the original event, byte for byte (it may be the invalid bytes an upstream published); the
facts travel in ``x-hookline-*`` headers. A stream rather than a queue, so that dead letters can be
listed any number of times without consuming them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import aio_pika
import orjson
import structlog
from aio_pika.abc import AbstractIncomingMessage
from pydantic import Field

from hookline.shared.headers import Header
from hookline.shared.ids import new_id
from hookline.shared.models import DeadLetterReason, Model
from hookline.shared.topology import ENDPOINT_QUEUE_PREFIX

log = structlog.get_logger(__name__)

MAX_ERROR_CHARS = 500


def dead_letter_message(
    body: bytes,
    *,
    reason: DeadLetterReason,
    endpoint_id: str,
    tenant: str | None,
    event_id: str | None,
    attempts: int,
    last_status: int | None,
    last_error: str,
    now: datetime,
    content_type: str | None = "application/json",
) -> aio_pika.Message:
    headers: dict[str, Any] = {
        Header.REASON: reason.value,
        Header.ENDPOINT_ID: endpoint_id,
        Header.ATTEMPTS: attempts,
        Header.LAST_ERROR: last_error[:MAX_ERROR_CHARS],
        Header.DEAD_AT: now.isoformat(),
    }
    if tenant is not None:
        headers[Header.TENANT] = tenant
    if event_id is not None:
        headers[Header.EVENT_ID] = event_id
    if last_status is not None:
        headers[Header.LAST_STATUS] = last_status
    return aio_pika.Message(
        body,
        headers=headers,
        content_type=content_type,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        # Unique per publish: aiormq matches returns to publishes by message_id.
        message_id=new_id("dl"),
        timestamp=now,
    )


#: A record in the dead-letter stream saying that these dead letters were redriven (body: {"ids": [...]}).
REDRIVEN_HEADER = "x-hookline-redriven"


class DeadLetterItem(Model):
    """A dead letter as the API lists it."""

    id: str = Field(description="dl_<stream offset>; stable, used to redrive one dead letter")
    event_id: str | None
    endpoint_id: str | None
    tenant: str | None
    type: str | None
    reason: DeadLetterReason
    attempts: int
    last_status: int | None
    last_error: str
    dead_at: datetime


def item_id(offset: int) -> str:
    return f"dl_{offset}"


def offset_of(dead_letter_id: str) -> int | None:
    number = dead_letter_id.removeprefix("dl_")
    return int(number) if number.isdigit() and dead_letter_id.startswith("dl_") else None


def read_item(
    offset: int,
    body: bytes,
    headers: Mapping[str, Any],
    *,
    message_id: str | None,
    timestamp: datetime | None,
) -> DeadLetterItem:
    """A dead letter from its stream message: ours carry ``x-hookline-*`` headers; the broker's own
    (a message over the endpoint queue's delivery limit) carry ``x-death`` instead."""
    event_type, body_tenant = _peek(body)
    if Header.REASON in headers:
        return DeadLetterItem(
            id=item_id(offset),
            event_id=_text(headers.get(Header.EVENT_ID)),
            endpoint_id=_text(headers.get(Header.ENDPOINT_ID)),
            tenant=_text(headers.get(Header.TENANT)) or body_tenant,
            type=event_type,
            reason=DeadLetterReason(_text(headers[Header.REASON]) or "unknown"),
            attempts=_int(headers.get(Header.ATTEMPTS)) or 0,
            last_status=_int(headers.get(Header.LAST_STATUS)),
            last_error=_text(headers.get(Header.LAST_ERROR)) or "",
            dead_at=_when(headers.get(Header.DEAD_AT)) or timestamp or datetime.now(UTC),
        )
    deaths = headers.get("x-death")
    death = deaths[0] if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping) else {}
    # RabbitMQ 3.10 leaves x-death out for delivery-limit dead letters; x-first-death-* are always set.
    queue = _text(death.get("queue")) or _text(headers.get("x-first-death-queue")) or ""
    broker_reason = _text(death.get("reason")) or _text(headers.get("x-first-death-reason")) or "unknown"
    return DeadLetterItem(
        id=item_id(offset),
        event_id=message_id,
        endpoint_id=queue.removeprefix(ENDPOINT_QUEUE_PREFIX)
        if queue.startswith(ENDPOINT_QUEUE_PREFIX)
        else None,
        tenant=body_tenant,
        type=event_type,
        reason=DeadLetterReason.DELIVERY_LIMIT,
        attempts=_int(headers.get(Header.ATTEMPT)) or 0,
        last_status=None,
        last_error=f"dead-lettered by the broker ({broker_reason}) from {queue or 'an unknown queue'}",
        dead_at=_when(death.get("time")) or timestamp or datetime.now(UTC),
    )


def _peek(body: bytes) -> tuple[str | None, str | None]:
    """The event's type and tenant when the body is an event, for listing; None otherwise."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(data, dict):
        return None, None
    event_type, tenant = data.get("type"), data.get("tenant")
    return (event_type if isinstance(event_type, str) else None, tenant if isinstance(tenant, str) else None)


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _when(value: object) -> datetime | None:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    text = _text(value)
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


class DeadLetterIndex:
    """The dead letters not yet redriven, in the order they died: what a follower of the stream
    ``hookline.dead-letters`` hands to :meth:`apply` (the ingest lists and redrives from it, the
    monitor analyses it)."""

    def __init__(self) -> None:
        self._items: dict[int, DeadLetterItem] = {}

    def apply(self, message: AbstractIncomingMessage) -> None:
        headers = message.headers or {}
        offset = headers.get("x-stream-offset")
        if not isinstance(offset, int):
            return
        if REDRIVEN_HEADER in headers:
            for redriven in orjson.loads(message.body).get("ids", []):
                self._items.pop(offset_of(redriven) or -1, None)
            return
        try:
            self._items[offset] = read_item(
                offset, message.body, headers, message_id=message.message_id, timestamp=message.timestamp
            )
        except ValueError as exc:
            log.error("dead_letter_unreadable", offset=offset, error=str(exc)[:200])

    def select(self, *, endpoint_id: str | None = None, tenant: str | None = None,
               reason: DeadLetterReason | None = None, event_id: str | None = None,
               ids: set[str] | None = None) -> list[DeadLetterItem]:  # fmt: skip
        return [
            item
            for item in self._items.values()
            if (endpoint_id is None or item.endpoint_id == endpoint_id)
            and (tenant is None or item.tenant == tenant)
            and (reason is None or item.reason is reason)
            and (event_id is None or item.event_id == event_id)
            and (ids is None or item.id in ids)
        ]

    def __len__(self) -> int:
        return len(self._items)

    def analysis(self, *, tenant: str | None = None) -> list[DeadLetterAnalysis]:
        """Per endpoint: how many, the most common error and status, first and last, mean attempts."""
        groups: dict[str | None, list[DeadLetterItem]] = {}
        for item in self._items.values():
            if tenant is None or item.tenant == tenant:
                groups.setdefault(item.endpoint_id, []).append(item)
        return [
            DeadLetterAnalysis(
                endpoint_id=endpoint_id,
                tenant=items[0].tenant,
                count=len(items),
                most_common_reason=Counter(item.reason for item in items).most_common(1)[0][0],
                most_common_error=Counter(item.last_error[:120] for item in items).most_common(1)[0][0],
                most_common_status=_most_common([item.last_status for item in items if item.last_status]),
                first_at=min(item.dead_at for item in items),
                last_at=max(item.dead_at for item in items),
                mean_attempts=round(sum(item.attempts for item in items) / len(items), 2),
            )
            for endpoint_id, items in sorted(groups.items(), key=lambda group: -len(group[1]))
        ]


class DeadLetterAnalysis(Model):
    endpoint_id: str | None
    tenant: str | None
    count: int
    most_common_reason: DeadLetterReason
    most_common_error: str
    most_common_status: int | None
    first_at: datetime
    last_at: datetime
    mean_attempts: float


def _most_common(values: list[int]) -> int | None:
    return Counter(values).most_common(1)[0][0] if values else None


def counts_since(index: DeadLetterIndex, since: datetime) -> Counter[str]:
    """Dead letters per endpoint that died at or after ``since`` (the "growing" alert)."""
    return Counter(item.endpoint_id for item in index.select() if item.dead_at >= since and item.endpoint_id)
