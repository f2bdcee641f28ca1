"""What dispatchers tell the health monitor: one record per attempt, and a heartbeat per replica.

Records travel in batches through the fanout exchange ``hookline.telemetry`` into the stream
``hookline.telemetry.log`` (25 h), from which a restarted monitor rebuilds its 24 h window. They are
published without confirms, off the delivery path: a batch lost in a broker failure is a gap in the
statistics, never a lost event.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal, TypedDict

from pydantic import Field, TypeAdapter

from hookline.shared.contracts.models import Model
from hookline.shared.outbound.delivery import AttemptResult
from hookline.shared.outbound.sealing import RESPONSE_PURPOSE, Sealer


class Outcome(enum.StrEnum):
    """An attempt's outcome: the dispatcher decides it (outcome.classify), the monitor counts it, the
    delivery log shows it. One definition, so that a renamed member cannot leave a reader comparing with
    a name nobody sends."""

    SUCCESS = "success"
    RETRY = "retry"  # failed, to be tried again (5xx, 408, 429, a timeout, a network error)
    PERMANENT = "permanent"  # failed, not worth trying again (another 4xx, a refused target)
    DISABLE = "disable"  # 410 Gone: the endpoint is disabled
    FAILED = "failed"  # an attempt made by hand (a resend, a verification) that did not succeed


#: Why an attempt was made: the first delivery of an event, a retry, a half-open breaker's probe, one
#: asked for by hand, an event replayed or redriven (a fresh budget), an endpoint's verification, a
#: test event sent to one endpoint, or an event fetched by a polling endpoint.
AttemptKind = Literal[
    "delivery", "retry", "probe", "manual", "replay", "redrive", "verification", "test", "poll"
]
#: Attempts made beside an event's course (by hand, an endpoint's verification or a test event, all by
#: the ingest): in the delivery log, but they neither settle an event nor count for the breaker or the
#: statistics.
ASIDE_KINDS: frozenset[str] = frozenset({"manual", "verification", "test"})


class AttemptRecord(Model):
    kind: Literal["attempt"] = "attempt"
    at_s: float  # unix seconds when the attempt ended
    dispatcher_id: str
    event_id: str
    endpoint_id: str
    tenant: str
    type: str
    attempt: int
    outcome: Outcome
    status: int | None
    error: str | None
    duration_ms: float
    dns_ms: float | None = None
    connect_ms: float | None = None
    first_byte_ms: float | None = None
    first_attempt_at_s: float
    next_attempt_at_s: float | None = None
    dead_letter_reason: str | None = None
    probe: bool = False  # the one delivery a half-open breaker lets through
    attempt_kind: AttemptKind = "delivery"
    response_headers: dict[str, str] = Field(default_factory=dict)
    response_body: str | None = None  # its first bytes; sealed (enc:v2:…) when HOOKLINE_SECRET_KEY is set


class Heartbeat(Model):
    kind: Literal["heartbeat"] = "heartbeat"
    at_s: float
    dispatcher_id: str
    in_flight: int
    consumers: int
    # Messages this dispatcher holds unacked, per endpoint (only those with some): what a queue's
    # ready count does not show, for the ingest's "events pending" check before a delete.
    unacked: dict[str, int] = Field(default_factory=dict)
    # The half-open breakers (endpoint id -> breaker version) this dispatcher has taken the probe of:
    # a prober that has not is asked no longer than a heartbeat or two.
    probing: dict[str, int] = Field(default_factory=dict)
    # The offset of the last endpoint change-log record this dispatcher has applied (None: none yet).
    # Sent at once when it moves: an ingest answers a new endpoint only once every live dispatcher has
    # applied its record, so that none fans an event out without it.
    applied_offset: int | None = None
    # A dispatcher shutting down says so in its last heartbeat: nobody waits for it any more.
    stopping: bool = False


class ExchangeFields(TypedDict):
    status: int | None
    error: str | None
    duration_ms: float
    dns_ms: float | None
    connect_ms: float | None
    first_byte_ms: float | None
    response_headers: dict[str, str]
    response_body: str | None


class AttemptFields(ExchangeFields):
    """An :class:`AttemptRecord` as it goes on the wire, built by the dispatcher on its delivery path
    without the model's validation (the receivers validate it); kept equal to the model by a unit test."""

    kind: Literal["attempt"]
    at_s: float
    dispatcher_id: str
    event_id: str
    endpoint_id: str
    tenant: str
    type: str
    attempt: int
    outcome: str
    first_attempt_at_s: float
    next_attempt_at_s: float | None
    dead_letter_reason: str | None
    probe: bool
    attempt_kind: AttemptKind


def exchange(result: AttemptResult, sealer: Sealer) -> ExchangeFields:
    """An attempt record's fields about the HTTP exchange: the status or error, the timings, and the
    start of the receiver's answer, sealed at rest (it may hold a customer's data)."""
    body = result.response_body
    return {
        "status": result.status,
        "error": result.error,
        "duration_ms": result.timings.total_ms,
        "dns_ms": result.timings.dns_ms,
        "connect_ms": result.timings.connect_ms,
        "first_byte_ms": result.timings.first_byte_ms,
        "response_headers": result.response_headers,
        "response_body": sealer.seal(body.decode("utf-8", "replace"), purpose=RESPONSE_PURPOSE)
        if body
        else None,
    }


DeferralReason = Literal["ordering", "pacing", "slow_share", "slow"]


class Deferral(Model):
    """An event put back without an attempt, not its turn yet: behind an earlier event of its subject
    (ordered endpoints), paced by the endpoint's rate limit or a 429's Retry-After, or waiting for the
    dispatchers' share of connections for slow endpoints (its endpoint is slow and that share is busy)."""

    kind: Literal["deferral"] = "deferral"
    at_s: float
    dispatcher_id: str
    event_id: str
    endpoint_id: str
    tenant: str
    reason: DeferralReason
    behind_event_id: str | None = None  # ordering: the earlier event it waits for
    until_s: float  # when it comes back from the delay queues


TelemetryRecord = Annotated[AttemptRecord | Heartbeat | Deferral, Field(discriminator="kind")]
batch: TypeAdapter[list[TelemetryRecord]] = TypeAdapter(list[TelemetryRecord])
