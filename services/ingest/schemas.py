"""The ingest API's request and response bodies (what only the ingest reads or writes); the records the
services share (an event, an endpoint, the change log's) are in :mod:`hookline.shared.contracts.models`."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Self

from pydantic import AfterValidator, AwareDatetime, Field, StringConstraints, model_validator

from hookline.shared.contracts.models import (
    BodyFormat,
    CustomHeaders,
    Endpoint,
    EndpointAuth,
    EndpointKind,
    ErrorDetail,
    Event,
    EventFields,
    EventId,
    EventType,
    EventTypeInfo,
    GzipOverBytes,
    JsonSchema,
    MaxAttempts,
    Model,
    Patterns,
    RetentionS,
    RetrySchedule,
    Tenant,
    TimeoutS,
    Url,
    Validation,
)
from hookline.shared.outbound import filters, transforms
from hookline.shared.runtime.api import ApiError


class EventIn(EventFields):
    """``POST /v1/events``: like :class:`Event`, but the API fills in ``id`` and ``occurred_at`` when absent."""

    def complete(self, *, event_id: str, now: datetime) -> Event:
        fields = dict(self) | {"id": self.id or event_id, "occurred_at": self.occurred_at or now}
        return Event(**fields)


class EventAccepted(Model):
    id: EventId
    tenant: Tenant
    type: EventType
    accepted_at: AwareDatetime
    # True: accepted before (same tenant and id, or Idempotency-Key) within HOOKLINE_DEDUPE_WINDOW_S;
    # nothing was published this time.
    duplicate: bool = False
    warnings: list[str] = Field(
        default_factory=list, description="what the event-type catalog says of it (validation: warn)"
    )


#: The most events one ``POST /v1/events/batch`` takes.
BATCH_MAX = 500


class BatchIn(Model):
    # Items are validated one by one (an invalid one is refused alone, with its index).
    events: list[dict[str, Any]] = Field(min_length=1, max_length=BATCH_MAX)


class ItemResult(Model):
    """One item of a batch: ``status`` as the single route would have answered it."""

    index: int
    status: int
    error: str | None = None
    message: str | None = None
    details: list[ErrorDetail] = Field(default_factory=list)
    retry_after_s: int | None = Field(
        None, description="over a quota or the broker refusing: when to send it again"
    )

    @classmethod
    def refused(cls, index: int, error: ApiError) -> Self:
        """The item as the single route would have refused it."""
        retry_after = error.headers.get("Retry-After")
        return cls(
            index=index,
            status=error.status,
            error=error.code,
            message=error.message,
            details=error.details,
            retry_after_s=int(retry_after) if retry_after else None,
        )


class BatchItem(ItemResult):
    event: EventAccepted | None = None


class BatchAccepted(Model):
    results: list[BatchItem]


#: What a polling endpoint may be given besides ``kind``, its tenant and patterns: the rest shapes pushes.
def _checked_filter(source: str) -> str:
    filters.check(source)  # FilterError is a ValueError: a 422 naming the field, the problem and where
    return source


EndpointFilter = Annotated[str, AfterValidator(_checked_filter)]


def _checked_transform(source: str) -> str:
    transforms.check(source)  # TransformError is a ValueError: a 422 naming the field and the problem
    return source


EndpointTransform = Annotated[str, AfterValidator(_checked_transform)]
FILTER_DESCRIPTION = (
    "a CEL expression over type, subject, tenant, schema_version, occurred_at, sequence and data that its "
    'events must also match (data.amount >= 1000 && data.currency == "EUR")'
)

POLLING_FIELDS = frozenset({"kind", "tenant", "event_types", "description", "retention_s", "notify_url",
                            "notify_format", "verify", "filter"})  # fmt: skip


class EndpointCreate(Model):
    tenant: Tenant
    kind: EndpointKind = "push"
    url: Url | None = Field(None, description="required for a push endpoint; a polling one has none")
    event_types: Patterns
    description: str = Field("", max_length=1000)
    rate_limit_per_s: float | None = Field(None, gt=0, le=100_000)
    max_in_flight: int | None = Field(None, ge=1, le=1000)
    timeout_s: TimeoutS = 15.0
    ordered: bool = False
    retry_schedule_s: RetrySchedule | None = None
    max_attempts: MaxAttempts | None = None
    retention_s: RetentionS | None = None
    body_format: BodyFormat = "event"
    notify_url: Url | None = Field(
        None, description="where hookline tells the tenant of this endpoint's trouble"
    )
    notify_format: BodyFormat = "event"
    headers: CustomHeaders | None = Field(None, description="sent with every delivery (values kept sealed)")
    auth: EndpointAuth | None = None
    gzip_over_bytes: GzipOverBytes | None = None
    filter: EndpointFilter | None = Field(None, description=FILTER_DESCRIPTION)
    transform: EndpointTransform | None = Field(
        None, description="a jq program over the event whose output is the body sent (signed as sent)"
    )
    verify: bool = Field(True, description="run the verification handshake (false: for development only)")

    @model_validator(mode="after")
    def _shaped_for_its_kind(self) -> Self:
        if self.kind == "push" and self.url is None:
            raise ValueError('url: a push endpoint needs one (or "kind": "polling")')
        if self.kind == "polling":
            fields = type(self).model_fields
            pushing = sorted(
                name
                for name in self.model_fields_set - POLLING_FIELDS
                if getattr(self, name) != fields[name].default  # "ordered": false says nothing
            )
            if pushing:
                raise ValueError(f"a polling endpoint takes no {', '.join(pushing)}: nothing is pushed to it")
        return self


class EndpointUpdate(Model):
    """``PATCH``: only the fields present change; ``null`` removes a limit. Adding or removing
    ``rate_limit_per_s``, ``max_in_flight`` or ``ordered`` moves the endpoint to a new queue."""

    url: Url | None = None
    event_types: Patterns | None = None
    description: str | None = Field(None, max_length=1000)
    rate_limit_per_s: float | None = Field(None, gt=0, le=100_000)
    max_in_flight: int | None = Field(None, ge=1, le=1000)
    ordered: bool | None = None
    timeout_s: TimeoutS | None = None
    retry_schedule_s: RetrySchedule | None = None
    max_attempts: MaxAttempts | None = None
    retention_s: RetentionS | None = None
    body_format: BodyFormat | None = None
    notify_url: Url | None = None
    notify_format: BodyFormat | None = None
    headers: CustomHeaders | None = Field(None, description="replaces them all; null removes them")
    auth: EndpointAuth | None = Field(None, description="replaces it; null removes it")
    gzip_over_bytes: GzipOverBytes | None = Field(None, description="null: bodies go uncompressed")
    filter: EndpointFilter | None = Field(None, description="null: every event its patterns match")
    transform: EndpointTransform | None = Field(None, description="null: the event is sent as it is")
    verify: bool = Field(True, description="verify the new url, when it changes, before delivering to it")


class EndpointCreated(Endpoint):
    """The answer to ``POST /v1/endpoints``: the only time the secret is shown unasked."""

    secret: str
    poll_token: str | None = None  # a polling endpoint's credential for its poll route: shown only here
    notify_secret: str | None = None  # signs what notify_url receives
    warnings: list[str] = Field(
        default_factory=list, description="patterns the event-type catalog does not know"
    )


#: Endpoints in one POST /v1/endpoints/batch.
ENDPOINT_BATCH_MAX = 500


class EndpointBatch(Model):
    # Items are validated one by one (an invalid one is refused alone, with its index).
    endpoints: list[dict[str, Any]] = Field(min_length=1, max_length=ENDPOINT_BATCH_MAX)


class EndpointBatchItem(ItemResult):
    endpoint: EndpointCreated | None = None


class EndpointBatchCreated(Model):
    results: list[EndpointBatchItem]


class EndpointSecret(Model):
    secret: str
    notify_secret: str | None = None


class RotateSecret(Model):
    overlap_s: int | None = Field(
        None, ge=0, le=7 * 86400, description="how long the previous secret keeps signing (default 24 h)"
    )


class RotatedSecret(Model):
    secret: str
    previous_expires_at: AwareDatetime


class EndpointList(Model):
    data: list[Endpoint]
    next_after: str | None = Field(None, description="pass as ?after= for the next page; null on the last")


class EventTypeUpdate(Model):
    description: str | None = Field(None, max_length=4000)
    schemas: dict[Annotated[str, StringConstraints(pattern=r"^[1-9][0-9]{0,5}$")], JsonSchema] | None = Field(
        None, max_length=50
    )
    examples: list[dict[str, Any]] | None = Field(None, max_length=20)
    deprecated: bool | None = None
    validation: Validation | None = None


class EventTypeList(Model):
    data: list[EventTypeInfo]
