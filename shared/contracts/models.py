"""Typed models for everything that crosses a boundary: events, endpoints, change-log and dead-letter records.

Every model forbids unknown fields, so a typo in a request or a message is an error that names the
field instead of a value silently ignored.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationError,
    model_serializer,
    model_validator,
)

EventId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:\-]{1,128}$")]
# A routing key is at most 255 bytes: the tenant (64) and a dot leave 190 for the type.
EventType = Annotated[str, StringConstraints(pattern=r"^[a-z0-9_]+(\.[a-z0-9_]+)*$", max_length=190)]
Tenant = Annotated[str, StringConstraints(pattern=r"^[a-z0-9_-]{1,64}$")]
TypePattern = Annotated[
    str, StringConstraints(pattern=r"^([a-z0-9_]+|\*|#)(\.([a-z0-9_]+|\*|#))*$", max_length=190)
]
EndpointId = Annotated[str, StringConstraints(pattern=r"^ep_[0-9A-Z]{26}$")]
#: An event's place among the events of its subject (receivers get it as ``webhook-sequence``); a
#: PostgreSQL bigint, as the outbox counts them.
SequenceNumber = Annotated[int, Field(ge=0, le=2**63 - 1, strict=True)]


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def error_summary(exc: ValidationError, *, limit: int = 3) -> str:
    """Where and why validation failed, never the input: a record may carry secrets or payload."""
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}"
        for error in exc.errors()[:limit]
    )


def check_sequence(sequence: int | None, subject: str | None) -> None:
    if sequence is not None and subject is None:
        raise ValueError("sequence needs a subject: it counts the events of one subject")


# --- events -------------------------------------------------------------------------------------


class EventFields(Model):
    """An event's fields and their rules, ``id`` and ``occurred_at`` not filled in yet (the ingest's
    ``EventIn``); :class:`Event` requires them. The order here is the published JSON's."""

    id: EventId | None = None
    type: EventType
    tenant: Tenant
    occurred_at: AwareDatetime | None = None
    subject: str | None = Field(None, min_length=1, max_length=256)
    sequence: SequenceNumber | None = None
    schema_version: int = Field(1, ge=1)
    data: dict[str, Any]

    @model_validator(mode="after")
    def _sequence_has_subject(self) -> Self:
        check_sequence(self.sequence, self.subject)
        return self


class Event(EventFields):
    """An event as upstreams publish it to the ``events`` exchange and receivers get it."""

    id: EventId
    occurred_at: AwareDatetime


#: Where an event stands at one endpoint (the delivery log's answer; the dashboard filters by it).
EventState = Literal[
    "delivered", "pending", "retrying", "dead", "paused", "breaker_open", "unverified", "disabled", "filtered"
]


# --- endpoints ----------------------------------------------------------------------------------


def _check_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise ValueError("must be an http or https URL")
    if not parts.hostname:
        raise ValueError("must name a host")
    if parts.fragment:
        raise ValueError("must not have a #fragment")
    return value


Url = Annotated[str, StringConstraints(min_length=1, max_length=2048), AfterValidator(_check_url)]
Patterns = Annotated[list[TypePattern], Field(min_length=1, max_length=64)]
TimeoutS = Annotated[float, Field(ge=1, le=30)]
# Per-endpoint retry overrides; None means the service-wide setting.
RetrySchedule = Annotated[
    list[Annotated[float, Field(gt=0, le=30 * 86400)]], Field(min_length=1, max_length=50)
]
MaxAttempts = Annotated[int, Field(ge=1, le=10_000)]
RetentionS = Annotated[float, Field(ge=60, le=30 * 86400)]


#: How a delivery's body is shaped: the event itself, or ``{"text": ...}`` for Slack-compatible incoming
#: webhooks (hookline.shared.state.notifications.render).
BodyFormat = Literal["event", "slack"]


#: Headers an endpoint may not set: hookline's own, the signature's, and what HTTP itself decides.
#: ``authorization`` is set through ``auth``.
RESERVED_HEADERS = frozenset(
    {
        "authorization", "connection", "content-encoding", "content-length", "content-type", "expect", "host", "keep-alive",
        "proxy-authorization", "te", "traceparent", "tracestate", "transfer-encoding", "upgrade", "user-agent",
    }
)  # fmt: skip
RESERVED_HEADER_PREFIXES = ("webhook-", "x-hookline-", "proxy-")

HeaderName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")]
HeaderValue = Annotated[str, StringConstraints(max_length=2048, pattern=r"^[^\r\n\x00]*$")]


def _unreserved(headers: dict[str, str]) -> dict[str, str]:
    names = [name.lower() for name in headers]
    for name in names:
        if name in RESERVED_HEADERS or name.startswith(RESERVED_HEADER_PREFIXES):
            raise ValueError(
                f"header {name!r} is reserved (hookline sets it, or HTTP does; auth: use 'auth')"
            )
    if len(set(names)) != len(names):
        raise ValueError("the same header twice (names are case-insensitive)")
    return headers


CustomHeaders = Annotated[dict[HeaderName, HeaderValue], Field(max_length=20), AfterValidator(_unreserved)]
Credential = Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^[^\r\n\x00]*$")]
Pem = Annotated[str, StringConstraints(min_length=1, max_length=65536)]


#: Bodies larger than this go gzip-compressed (``content-encoding: gzip``); the signature is over the
#: uncompressed body, so a receiver inflates before it verifies.
GzipOverBytes = Annotated[
    int,
    Field(
        ge=0,
        le=16 * 1024 * 1024,
        description="compress bodies larger than this many bytes with gzip (signed uncompressed)",
    ),
]


class BasicAuth(Model):
    type: Literal["basic"]
    username: Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[^:\r\n\x00]*$")]
    password: Credential  # sealed once stored

    def summary(self) -> AuthSummary:
        return AuthSummary(type=self.type, username=self.username)


class BearerAuth(Model):
    type: Literal["bearer"]
    token: Credential  # sealed once stored

    def summary(self) -> AuthSummary:
        return AuthSummary(type=self.type)


class OAuth2ClientCredentials(Model):
    """A token from ``token_url`` (RFC 6749 §4.4, the client authenticated with HTTP basic), cached and
    refreshed before it expires; a 401 from the endpoint fetches a new one once, in the same attempt."""

    type: Literal["oauth2_client_credentials"]
    token_url: Url
    client_id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    client_secret: Credential  # sealed once stored
    scope: Annotated[str, StringConstraints(max_length=1024)] | None = None
    audience: Annotated[str, StringConstraints(max_length=1024)] | None = None

    def summary(self) -> AuthSummary:
        return AuthSummary(
            type=self.type, client_id=self.client_id, token_url=self.token_url, scope=self.scope,
            audience=self.audience,
        )  # fmt: skip


class MtlsAuth(Model):
    """A TLS client certificate (PEM, with any intermediates after it) and its private key."""

    type: Literal["mtls"]
    certificate: Pem
    private_key: Pem  # sealed once stored

    def summary(self) -> AuthSummary:
        return AuthSummary(type=self.type)


EndpointAuth = Annotated[
    BasicAuth | BearerAuth | OAuth2ClientCredentials | MtlsAuth, Field(discriminator="type")
]


class AuthSummary(Model):
    """What the API shows of an endpoint's auth: never a password, token, client secret or key."""

    type: str
    username: str | None = None
    client_id: str | None = None
    token_url: str | None = None
    scope: str | None = None
    audience: str | None = None


#: How an endpoint gets its events: pushed to its URL, or fetched by the customer (``GET
#: /v1/endpoints/{id}/poll``): a polling endpoint has no URL, no lane membership and no queue.
EndpointKind = Literal["push", "polling"]


class EndpointStatus(enum.StrEnum):
    ACTIVE = "active"
    PAUSED = "paused"
    DISABLED = "disabled"


class Verification(Model):
    """The last verification handshake: a signed hookline.endpoint.verification POST."""

    ok: bool
    at: AwareDatetime
    status: int | None = None
    error: str | None = None


class Endpoint(Model):
    """An endpoint as the API shows it: everything but its secrets."""

    id: EndpointId
    tenant: Tenant
    kind: EndpointKind = "push"
    url: Url | None = None  # None: a polling endpoint
    event_types: Patterns
    description: str = ""
    rate_limit_per_s: float | None = None
    max_in_flight: int | None = None
    timeout_s: TimeoutS = 15.0
    ordered: bool = False
    retry_schedule_s: RetrySchedule | None = None
    max_attempts: MaxAttempts | None = None
    retention_s: RetentionS | None = None
    body_format: BodyFormat = "event"
    notify_url: Url | None = None  # operational notifications (hookline.shared.state.notifications)
    notify_format: BodyFormat = "event"
    headers: list[str] = Field(
        default_factory=list, description="the names of its headers (values never shown)"
    )
    auth: AuthSummary | None = None
    gzip_over_bytes: GzipOverBytes | None = None
    filter: str | None = Field(
        None, description="a CEL expression its events must match (shared/outbound/filters.py)"
    )
    transform: str | None = Field(
        None, description="a jq program making the body sent (shared/outbound/transforms.py)"
    )
    status: EndpointStatus = EndpointStatus.ACTIVE
    verified: bool = Field(True, description="deliveries go only to verified endpoints")
    verification: Verification | None = None
    created_at: AwareDatetime
    updated_at: AwareDatetime
    version: int = Field(
        0, description="increases with every change; send it as If-Match to change only that version"
    )

    @property
    def single_consumer(self) -> bool:
        """Ordered and rate- or concurrency-limited endpoints are served by one dispatcher at a time."""
        return self.ordered or self.max_in_flight is not None or self.rate_limit_per_s is not None


class SigningSecret(Model):
    # A whsec_ secret, or the same encrypted with HOOKLINE_SECRET_KEY ("enc:v2:...", or v1 before HKDF).
    value: str = Field(pattern=r"^(whsec_[A-Za-z0-9+/=]{24,128}|enc:v[12]:[A-Za-z0-9+/=_-]{40,300})$")
    created_at: AwareDatetime
    expires_at: AwareDatetime | None = None


class StoredEndpoint(Endpoint):
    """An endpoint as the change log keeps it: with its signing secrets (newest first) and its queues.

    ``queue_generation`` names its queue of its own, while it has one (:func:`topology.own_queue`; it is
    delivered from its tenant's lane otherwise, :mod:`hookline.shared.broker.placement`); a change of the
    options that shape a queue moves it to the next generation, and the queues it left are
    ``retired_queues``: dispatchers drain them into its address.
    """

    secrets: list[SigningSecret] = Field(min_length=1)
    queue_generation: int = Field(0, ge=0)
    retired_queues: list[str] = Field(default_factory=list, max_length=100)
    # Endpoints of the versions before lanes: ``routed`` had route exchanges, neither had its queue
    # bound to ``events`` directly. The ingest moves them onto their lane at its start (``laned``).
    routed: bool = False
    laned: bool = False
    # An ``ordered`` endpoint's queue of its own is bound to ``events`` for its patterns from the moment
    # it is ordered (``straight``; not laned, but while it leaves its lane): through a lane, two
    # dispatchers each handing on one of two events of a subject could put them in its queue the other
    # way round.
    straight: bool = False
    # Made ordered while laned, it leaves its lane in two steps: its queue bound to ``events`` and this
    # fence's id written (``straight`` and ``laned`` both: fanned out still, its lane copies handed on
    # as duplicates); once the fence has come out of its lane, every lane message published before
    # that binding has been given out, and ``laned`` goes (``left_lane_at``: a lane message given out
    # a moment before still counts it, see ``dispatcher/fanout.py``).
    lane_fence: str | None = None
    left_lane_at: AwareDatetime | None = None
    # What the endpoint's requests carry, secrets sealed (header values, the auth's password, token,
    # client secret or key); ``headers`` and ``auth`` are what the API shows of them.
    sealed_headers: dict[str, str] = Field(default_factory=dict)
    sealed_auth: EndpointAuth | None = None
    # A polling endpoint's poll token, as a SHA-256 hex digest (the token is shown once, at creation).
    poll_token_hash: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")

    @property
    def polling(self) -> bool:
        """Fetched by the customer: never fanned out to, bound for, queued or delivered to."""
        return self.kind == "polling"

    @property
    def on_lane(self) -> bool:
        """Fanned out to from its tenant's lane, which is bound for its patterns: laned, and pushed to."""
        return self.laned and not self.polling

    def public(self) -> Endpoint:
        return Endpoint.model_validate(
            self.model_dump(
                exclude={
                    "secrets",
                    "queue_generation",
                    "retired_queues",
                    "routed",
                    "laned",
                    "straight",
                    "lane_fence",
                    "left_lane_at",
                    "sealed_headers",
                    "sealed_auth",
                    "poll_token_hash",
                }
            )
        )


# --- the endpoint change log --------------------------------------------------------------------


# A change applies only if the endpoint is still at ``base_version`` when a reader reaches the record
# (0: the endpoint must not exist yet); every reader applies the same rule in the same order, so all
# agree on which of two concurrent writes won. None: unconditional (records of earlier versions).


# --- the event-type catalog --------------------------------------------------------------------


#: What the catalog does with an event of a type it describes: nothing, say so (a warning in the answer
#: and the log), or refuse it (422 over HTTP; an ``invalid_event`` dead letter over AMQP).
Validation = Literal["off", "warn", "enforce"]
JsonSchema = dict[str, Any]


class EventTypeCreate(Model):
    name: EventType
    description: str = Field("", max_length=4000)
    # JSON Schema (2020-12) of the event's ``data``, per ``schema_version`` ("1", "2", ...).
    schemas: dict[Annotated[str, StringConstraints(pattern=r"^[1-9][0-9]{0,5}$")], JsonSchema] = Field(
        default_factory=dict, max_length=50
    )
    examples: list[dict[str, Any]] = Field(default_factory=list, max_length=20, description="example data")
    deprecated: bool = False
    validation: Validation = "off"


class EventTypeInfo(EventTypeCreate):
    created_at: AwareDatetime
    updated_at: AwareDatetime
    version: int = 0


class EventTypeUpserted(Model):
    kind: Literal["event_type.upserted"] = "event_type.upserted"
    change_id: str
    at: AwareDatetime
    event_type: EventTypeInfo
    base_version: int | None = None


class EventTypeDeleted(Model):
    kind: Literal["event_type.deleted"] = "event_type.deleted"
    change_id: str
    at: AwareDatetime
    name: EventType
    base_version: int | None = None


class EndpointUpserted(Model):
    kind: Literal["endpoint.upserted"] = "endpoint.upserted"
    change_id: str
    at: AwareDatetime
    endpoint: StoredEndpoint
    base_version: int | None = None


class EndpointsUpserted(Model):
    """Endpoints written at once (the batch route): each applied as its own :class:`EndpointUpserted`
    would be, in order, one that lost its condition not stopping the others. One record for many is one
    publish, one confirm and one delivery to each follower instead of one each: what registration at
    1,000 endpoints a second needs. Versions before this one skip it as unreadable (upgrade the services
    that follow the change log before the ingests)."""

    kind: Literal["endpoints.upserted"] = "endpoints.upserted"
    change_id: str
    at: AwareDatetime
    upserts: list[EndpointUpserted] = Field(min_length=1)


class EndpointDeleted(Model):
    kind: Literal["endpoint.deleted"] = "endpoint.deleted"
    change_id: str
    at: AwareDatetime
    endpoint_id: EndpointId
    base_version: int | None = None


class EndpointDrained(Model):
    """A deleted endpoint's lane has passed the fence the ingest put in it after the deletion: every lane
    message published before the deletion has been given out, so the fan-out stops counting the endpoint
    (until then its copies become ``endpoint_gone`` dead letters). Written by the dispatcher that took the
    fence; idempotent."""

    kind: Literal["endpoint.drained"] = "endpoint.drained"
    change_id: str
    at: AwareDatetime
    endpoint_id: EndpointId


class DirectRoute(Model):
    """An isolated endpoint's queue of its own bound to ``events`` for the endpoint's patterns, and its
    lane no longer bound for them: its events reach it without passing through the lane
    (:mod:`hookline.health_monitor.direct`)."""

    queue: str = Field(max_length=255, description="the queue of its own bound (its generation then)")
    patterns: tuple[TypePattern, ...] = Field(min_length=1, max_length=100)


class Placement(Model):
    """Where an endpoint is delivered from, as far as it is decided at run time (its options and status
    decide the rest: :mod:`hookline.shared.broker.placement`): from its lane, or from a queue of its own."""

    endpoint_id: EndpointId
    generation: int = Field(ge=1, description="one more with every change")
    isolated: bool
    reason: str = Field("", max_length=64, description="why: breaker_open, slow, backlogged, replay, …")
    at: AwareDatetime
    # Isolated past the bound on queues of their own: in a shared holding lane, not a queue of its own.
    held: bool = False
    # The writer's bound on queues of their own: applied where the change log already has that many (other
    # processes' isolations came first), the placement holds the endpoint instead, on every replica alike.
    bound: int | None = Field(None, ge=0)
    # Its queue of its own bound to ``events`` directly (only ever while isolated with one).
    direct: DirectRoute | None = None

    @model_serializer(mode="wrap")
    def _written(self, write: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Without ``held``, ``bound`` and ``direct`` unless set: a version before them refuses fields it
        does not know (it would skip every placement record), and reads one without them as before."""
        written: dict[str, Any] = write(self)
        if not self.held:
            written.pop("held", None)
        if self.bound is None:
            written.pop("bound", None)
        if self.direct is None:
            written.pop("direct", None)
        return written

    # Written by the leading monitor once it has removed the endpoint's queue of its own (empty, and no
    # replica hands anything to it any more): from here on nobody consumes or counts it.
    queue_removed: bool = False


class PlacementSet(Model):
    """A placement change, applied only if the endpoint's placement is still at ``base_generation`` (0:
    none yet): apart from the endpoint's version, so that it never makes an edit of the endpoint stale."""

    kind: Literal["placement.set"] = "placement.set"
    change_id: str
    at: AwareDatetime
    placement: Placement
    base_generation: int = Field(ge=0)


# --- tenants: API tokens and quotas, kept in the change log ----------------------------------------


class PortalGrant(Model):
    """What a customer portal link, or the session it opened, may see and do (one tenant always)."""

    role: Literal["link", "session"]
    endpoint_ids: list[str] | None = Field(None, description="only these endpoints; null: the tenant's all")
    read_only: bool = False


class StoredToken(Model):
    """A credential as the change log keeps it: its SHA-256, never the token. A tenant's API token
    (``tok_``), or a customer portal's link (``pll_``) or session (``pls_``, opened from the link with the
    same id after the prefix, so that the change log's order decides which opening of a link wins)."""

    id: str = Field(pattern=r"^(tok|pll|pls)_[0-9A-Z]{26}$")
    tenant: Tenant
    prefix: str = Field(description="the token's first characters, to tell it apart in a list")
    digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the token, hex")
    description: str = Field("", max_length=200)
    created_at: AwareDatetime
    expires_at: AwareDatetime | None = None
    revoked_at: AwareDatetime | None = None
    portal: PortalGrant | None = None  # None: a tenant API token


class TokenUpserted(Model):
    kind: Literal["token.upserted"] = "token.upserted"
    change_id: str
    at: AwareDatetime
    token: StoredToken


class TenantQuota(Model):
    """What the admin allows one tenant; null: no limit."""

    max_endpoints: int | None = Field(None, ge=0, description="endpoints the tenant may have")
    events_per_s: float | None = Field(
        None, gt=0, description="events accepted per second through the API, per ingest replica"
    )
    burst: int | None = Field(None, ge=1, description="events accepted at once (default: one second's worth)")
    bytes_per_day: int | None = Field(None, ge=0, description="event bytes accepted per UTC day")


class QuotaSet(Model):
    kind: Literal["tenant.quota_set"] = "tenant.quota_set"
    change_id: str
    at: AwareDatetime
    tenant: Tenant
    quota: TenantQuota


ChangeRecord = Annotated[
    EndpointUpserted
    | EndpointsUpserted
    | EndpointDeleted
    | EndpointDrained
    | PlacementSet
    | EventTypeUpserted
    | EventTypeDeleted
    | TokenUpserted
    | QuotaSet,
    Field(discriminator="kind"),
]


# --- dead letters -------------------------------------------------------------------------------


class DeadLetterReason(enum.StrEnum):
    MAX_ATTEMPTS = "max_attempts"
    RETENTION_EXPIRED = "retention_expired"
    PERMANENT_STATUS = "permanent_status"
    ENDPOINT_GONE = "endpoint_gone"
    INVALID_EVENT = "invalid_event"
    UNROUTABLE = "unroutable"
    DELIVERY_LIMIT = "delivery_limit"
    TRANSFORM_FAILED = "transform_failed"


class ErrorDetail(Model):
    field: str | None = None
    message: str


class ErrorBody(Model):
    error: str
    message: str
    details: list[ErrorDetail] = []
