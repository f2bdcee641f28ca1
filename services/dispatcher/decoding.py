"""Reading a message off an endpoint queue: the event inside it, or the reason it is not one.

Upstreams may publish anything to ``events``; whatever fails these checks is dead-lettered as
``invalid_event`` with the reason, never retried and never dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from hookline.shared.broker import topology
from hookline.shared.contracts.headers import Header
from hookline.shared.contracts.models import Event, error_summary
from hookline.shared.runtime import tracing
from hookline.shared.runtime.tracing import TraceContext

_MAX_REASONS = 3

Origin = Literal["replay", "redrive"]


@dataclass(frozen=True, slots=True)
class Inbound:
    event: Event
    attempt: int  # the attempt this delivery is, starting at 1
    first_attempt_at_s: float | None  # unix seconds of attempt 1, when this is a retry
    sequence: int | None = None  # ordered endpoints: the event's place in its subject
    origin: Origin | None = None  # put back by hand (replay, redrive): the delivery log tells them apart
    trace: TraceContext | None = None  # the publisher's W3C trace context, sent on with every attempt
    second_copy: bool = False  # handed on from a lane, most likely come straight from events too


@dataclass(frozen=True, slots=True)
class Invalid:
    reason: str
    event_id: str | None


def parse(
    body: bytes,
    *,
    message_id: str | None,
    content_type: str | None,
    exchange: str | None,
    routing_key: str | None,
    headers: Mapping[str, Any] | None,
    endpoint_tenant: str,
    max_bytes: int,
) -> Inbound | Invalid:
    """Check a message against the event contract (DESIGN.md, "The event")."""
    if len(body) > max_bytes:
        return Invalid(f"body is {len(body)} bytes, over the limit of {max_bytes}", message_id)
    if (content_type or "").split(";")[0].strip().lower() != "application/json":
        return Invalid(f"content_type must be application/json, not {content_type!r}", message_id)
    if not message_id:
        return Invalid("message_id property is missing (it must be the event id)", None)
    try:
        event = Event.model_validate_json(body)
    except ValidationError as exc:
        return Invalid(error_summary(exc, limit=_MAX_REASONS), message_id)
    if event.id != message_id:
        return Invalid(f"message_id {message_id!r} differs from the body's id", message_id)
    if exchange == topology.EVENTS_EXCHANGE and routing_key != topology.event_routing_key(
        event.tenant, event.type
    ):
        return Invalid(f"routing key {routing_key!r} does not match the body's tenant and type", event.id)
    if event.tenant != endpoint_tenant:
        return Invalid("the event's tenant is not the endpoint's tenant", event.id)
    if exchange == topology.EVENTS_EXCHANGE:
        # Straight from an upstream: hookline's own headers on it are not hookline's (a publisher could
        # otherwise claim attempt 999, or an old first attempt, and have the event dead at once).
        return Inbound(event=event, attempt=1, first_attempt_at_s=None, trace=tracing.from_headers(headers))
    headers = headers or {}
    return Inbound(
        event=event,
        attempt=_positive_int(headers.get(Header.ATTEMPT), default=1),
        first_attempt_at_s=_float(headers.get(Header.FIRST_ATTEMPT_AT)),
        sequence=_positive_int(headers.get(Header.SEQUENCE), default=0) or None,
        origin=_origin(headers.get(Header.ORIGIN)),
        trace=tracing.from_headers(headers),
        second_copy=headers.get(Header.SECOND_COPY) == 1,
    )


def _origin(value: object) -> Origin | None:
    return "replay" if value == "replay" else "redrive" if value == "redrive" else None


def _positive_int(value: object, *, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default


def _float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None
