"""Outbox rows as events, and the order they may go in: pure, no I/O.

A subject's rows go in its order (by ``sequence`` when they are numbered, else by creation); a row
may go only when no earlier unsent row of its subject is held elsewhere (claimed by another relay,
or not claimed at all because the batch ended before it). Rows without a subject go in creation order
as far as one relay's batch goes, and are never held back.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import orjson
from pydantic import ValidationError

from hookline.shared.contracts.models import Event, error_summary

#: A subject is the tenant's: two tenants' "order_1" are two subjects.
SubjectKey = tuple[str, str]
#: A row's place in its subject: numbered rows by sequence, then unnumbered ones by creation.
OrderKey = tuple[bool, int, int]


@dataclass(frozen=True, slots=True)
class OutboxRow:
    position: int
    id: str
    tenant: str
    type: str
    subject: str | None
    sequence: int | None
    schema_version: int
    data: str  # the jsonb column as JSON text, put into the body as it is
    occurred_at: datetime
    traceparent: str | None
    created_at: datetime

    @property
    def subject_key(self) -> SubjectKey | None:
        return None if self.subject is None else (self.tenant, self.subject)

    @property
    def order_key(self) -> OrderKey:
        return order_key(self.sequence, self.position)


def order_key(sequence: int | None, position: int) -> OrderKey:
    return (sequence is None, sequence or 0, position)


@dataclass(frozen=True, slots=True)
class Ready:
    row: OutboxRow
    event: Event
    body: bytes


@dataclass(frozen=True, slots=True)
class Refused:
    row: OutboxRow
    reason: str


def prepare(row: OutboxRow, *, max_bytes: int) -> Ready | Refused:
    """The event a row makes, as receivers will get it, or why it makes none."""
    envelope: dict[str, object] = {
        "id": row.id,
        "type": row.type,
        "tenant": row.tenant,
        "occurred_at": row.occurred_at.astimezone(UTC),
        "subject": row.subject,
        "sequence": row.sequence,
        "schema_version": row.schema_version,
        "data": orjson.Fragment(row.data),
    }
    body = orjson.dumps(
        {name: value for name, value in envelope.items() if value is not None}, option=orjson.OPT_UTC_Z
    )
    if len(body) > max_bytes:
        return Refused(row, f"the event is {len(body)} bytes, over HOOKLINE_MAX_PAYLOAD_BYTES ({max_bytes})")
    try:
        event = Event.model_validate_json(body)
    except ValidationError as exc:
        return Refused(row, error_summary(exc))
    return Ready(row, event, body)


def held_back(
    claimed: Sequence[OutboxRow], first_elsewhere: Mapping[SubjectKey, OrderKey]
) -> tuple[list[OutboxRow], list[OutboxRow]]:
    """Split a claim into the rows that may go now and those that wait for an earlier row of their
    subject held elsewhere (``first_elsewhere``: the earliest unsent row of each subject not claimed)."""
    going: list[OutboxRow] = []
    waiting: list[OutboxRow] = []
    for row in claimed:
        key = row.subject_key
        blocker = None if key is None else first_elsewhere.get(key)
        (waiting if blocker is not None and blocker < row.order_key else going).append(row)
    return going, waiting


def publish_order(rows: Sequence[Ready]) -> list[Ready]:
    """``rows`` (in creation order) with each subject's rows put in its order, in the places its rows
    held: creation order across subjects, the subject's order within one."""
    places: dict[SubjectKey, list[int]] = defaultdict(list)
    for index, ready in enumerate(rows):
        if (key := ready.row.subject_key) is not None:
            places[key].append(index)
    ordered = list(rows)
    for indexes in places.values():
        in_order = sorted((rows[i] for i in indexes), key=lambda ready: ready.row.order_key)
        for index, ready in zip(indexes, in_order, strict=True):
            ordered[index] = ready
    return ordered
