"""Settings, read once from ``HOOKLINE_*`` environment variables at a service's start and passed down.

Each service has its own class so that a dispatcher never needs the API token and the ingest never
needs a metrics port; the fields they share live in :class:`CommonSettings`. A bad value stops the
service with one line naming the variable (:func:`load`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from hookline.shared.broker.topology import Retention
from hookline.shared.outbound import sealing, signing

LogLevel = Literal["debug", "info", "warning", "error"]


#: API tokens published in this repository (compose.yaml's fallback): anyone could use them.
DEVELOPMENT_TOKENS = frozenset({"local-dev-token-change-me"})


def _api_token(value: SecretStr, *, development: bool) -> SecretStr:
    token = value.get_secret_value()
    if len(token) < 16:
        raise ValueError("must be at least 16 characters")
    if token in DEVELOPMENT_TOKENS and not development:
        raise ValueError(
            "is the development token published in compose.yaml: set one of your own "
            "(openssl rand -hex 32), or HOOKLINE_DEVELOPMENT=true on a laptop"
        )
    return value


def _checked_api_token(value: SecretStr, info: ValidationInfo) -> SecretStr:
    # ``development`` is a field of CommonSettings, validated before any service's own fields.
    return _api_token(value, development=bool(info.data.get("development")))


#: The admin token of the ingest and the monitor (one rule for both).
ApiToken = Annotated[SecretStr, AfterValidator(_checked_api_token)]


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HOOKLINE_", extra="ignore", frozen=True)

    development: bool = Field(
        False, description="A laptop: accept the development API token compose.yaml falls back to."
    )
    amqp_url: str = Field(
        "amqp://guest:guest@localhost:5672/",
        description="RabbitMQ URL, vhost included; a cluster: its nodes' URLs, comma separated, tried in turn.",
    )
    log_level: LogLevel = "info"
    nice: int = Field(
        0,
        ge=0,
        le=19,
        description="Niceness added to the process at start: on a machine shared with dispatchers, an "
        "ingest or monitor at 10 yields the CPU to the delivery path (README, Operations).",
    )
    otlp_endpoint: str | None = Field(
        None,
        description="Export traces over OTLP/HTTP to this collector (http://host:4318); unset: none exported.",
    )
    connect_timeout_s: float = Field(
        30.0, gt=0, description="How long a service waits for the broker at start."
    )
    shutdown_grace_s: float = Field(20.0, gt=0, description="Time in-flight work gets to finish on SIGTERM.")
    secret_key: SecretStr | None = Field(
        None, description="Seals signing secrets at rest in the endpoint log (32+ random characters)."
    )
    event_log_max_age_s: int = Field(
        604_800, ge=3600, description="How long accepted events are kept for replay (stream retention)."
    )
    event_log_max_bytes: int = Field(
        20_000_000_000, ge=10_000_000, description="Disk the event log may take; the oldest events go first."
    )
    dead_letter_max_bytes: int = Field(
        5_000_000_000, ge=10_000_000, description="Disk the dead-letter stream may take (30 days at most)."
    )
    telemetry_max_bytes: int = Field(
        4_000_000_000, ge=10_000_000, description="Disk the telemetry stream may take (25 hours at most)."
    )
    rabbitmq_management_url: str | None = Field(
        None,
        description="The management API (http://user:pass@host:15672), for the broker's alarms, disk and file handles.",
    )
    rabbitmq_diagnostics: str | None = Field(
        "rabbitmq-diagnostics",
        description="Without a management URL: the CLI that reads them, used when the broker is on this host.",
    )
    max_endpoint_queues: int = Field(
        200,
        ge=0,
        description="Endpoints that may have a queue of their own at once (limits, paused, breaker open, "
        "slow...; each a quorum queue: on RabbitMQ 3.x three file handles); past it a new one is refused "
        "(503) or, if only slow or backlogged, delivered from its lane.",
    )
    state_dir: Path = Field(
        Path(".hookline/state"),
        description="Where each replica keeps its local views (SQLite); rebuilt from the streams if lost.",
    )

    @property
    def retention(self) -> Retention:
        return Retention(
            event_log_max_age_s=self.event_log_max_age_s,
            event_log_max_bytes=self.event_log_max_bytes,
            dead_letter_max_bytes=self.dead_letter_max_bytes,
            telemetry_max_bytes=self.telemetry_max_bytes,
        )

    def state_file(self, service: str, port: int) -> Path:
        """This replica's view file: one per service and port, so replicas on one host never share one."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        return self.state_dir / f"{service}-{port}.sqlite"

    @field_validator("secret_key")
    @classmethod
    def _sealing_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            sealing.check_key(value.get_secret_value())
        return value

    @field_validator("amqp_url")
    @classmethod
    def _amqp_scheme(cls, value: str) -> str:
        urls = [url.strip() for url in value.split(",") if url.strip()]
        if not urls:
            raise ValueError("name at least one broker (amqp://user:password@host:5672/vhost)")
        if not all(url.startswith(("amqp://", "amqps://")) for url in urls):
            raise ValueError("each address must start with amqp:// or amqps://")
        if len({urlsplit(url).path.strip("/") for url in urls}) > 1:
            raise ValueError("every address must name the same vhost (they are one cluster's nodes)")
        return value


class DeliveryPolicySettings(CommonSettings):
    """Settings that decide where and how an endpoint may be called (ingest and dispatcher both apply them)."""

    allow_http: bool = Field(False, description="Accept http:// endpoint URLs (development only).")
    allow_private_targets: bool = Field(
        False, description="Accept endpoints that resolve to private, loopback or reserved addresses."
    )
    response_capture_bytes: int = Field(
        4096,
        ge=0,
        le=65536,
        description="What the delivery log keeps of each response body (sealed at rest).",
    )
    egress_proxy: str | None = Field(
        None,
        description="Send every request to endpoints through this HTTP proxy (static source addresses); "
        "targets are still checked before they are sent.",
    )

    @field_validator("egress_proxy")
    @classmethod
    def _proxy_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// proxy URL")
        return value


#: HOOKLINE_METRICS_TOKEN of the ingest and the monitor (the dispatcher, having no API token, differs).
_METRICS_READER_DESCRIPTION = (
    "A read-only bearer token for Prometheus scrapes of /metrics (at least 16 characters); "
    "unset: the API token."
)


def _metrics_token(value: SecretStr | None) -> SecretStr | None:
    # Empty is unset, so that compose can pass ${HOOKLINE_METRICS_TOKEN:-} through without a default.
    if value is None or not value.get_secret_value():
        return None
    if len(value.get_secret_value()) < 16:
        raise ValueError("must be at least 16 characters")
    return value


MetricsToken = Annotated[SecretStr | None, AfterValidator(_metrics_token)]


class IngestSettings(DeliveryPolicySettings):
    api_token: ApiToken = Field(description="Admin bearer token for the HTTP API (at least 16 characters).")
    metrics_token: MetricsToken = Field(None, description=_METRICS_READER_DESCRIPTION)
    tenant_tokens: SecretStr | None = Field(
        None,
        description="tenant:token pairs, comma separated: a token that sees and publishes for its tenant only.",
    )
    secret_rotation_overlap_s: int = Field(
        86_400, ge=0, description="How long a rotated-out secret keeps signing."
    )
    ingest_host: str = "127.0.0.1"
    ingest_port: int = Field(8000, ge=0, le=65535)
    max_payload_bytes: int = Field(262_144, ge=1024, le=16 * 1024 * 1024)
    max_batch_bytes: int = Field(
        4_194_304, ge=1024, le=256 * 1024 * 1024, description="Largest POST /v1/events/batch body."
    )
    registry_wait_s: float = Field(
        10.0, gt=0, description="How long a write waits to be read back from the log."
    )
    delivery_log_retention_s: float = Field(
        604_800.0, gt=0, description="How long the delivery log keeps events and attempts."
    )
    delivery_log_max_bytes: int = Field(
        10_000_000_000,
        ge=10_000_000,
        description="The delivery log's files stay under this; past it the oldest rows go first.",
    )
    dedupe_window_s: float = Field(
        86_400.0,
        ge=0,
        description="A POST /v1/events repeating an id (or Idempotency-Key) accepted this recently publishes "
        "nothing and answers 200 duplicate (0: off).",
    )
    portal_url: str = Field(
        "http://127.0.0.1:8001",
        description="The health monitor's address as customers' browsers reach it: portal links start with it.",
    )
    broker_fd_reserve: int = Field(
        100,
        ge=0,
        description="File handles a new endpoint must leave the broker (each quorum queue takes one), else 503.",
    )

    @field_validator("dedupe_window_s")
    @classmethod
    def _dedupe_within_the_log(cls, value: float, info: ValidationInfo) -> float:
        # Duplicates are found in the delivery log's events: it must keep them for the whole window.
        retention_s = info.data.get("delivery_log_retention_s")
        if retention_s is not None and value > retention_s:
            raise ValueError(
                "must not exceed HOOKLINE_DELIVERY_LOG_RETENTION_S (duplicates are looked up in the delivery log)"
            )
        return value


class DispatcherSettings(DeliveryPolicySettings):
    dispatcher_metrics_host: str = "127.0.0.1"
    dispatcher_metrics_port: int = Field(8002, ge=0, le=65535, description="0 picks a free port.")
    metrics_token: MetricsToken = Field(
        None,
        description="A bearer token the metrics port's /metrics then requires (at least 16 characters); "
        "unset: open, as the dispatcher has no API token.",
    )
    prefetch_per_endpoint: int = Field(
        16,
        ge=1,
        le=1000,
        description="Deliveries one dispatcher holds per endpoint (past it, from a lane, the endpoint is "
        "backlogged and gets a queue of its own); while the dispatcher's event loop runs late, 8 of them under "
        "way at once.",
    )
    lane_prefetch: int = Field(
        256,
        ge=1,
        le=2000,
        description="Lane messages one dispatcher holds per lane at once (each fanned out).",
    )
    http_max_connections: int = Field(
        512,
        ge=4,
        description="Attempts (each an outbound connection) one dispatcher has under way at once.",
    )
    slow_share: float = Field(
        0.25,
        ge=0.05,
        le=0.75,
        description="Of those, the share slow endpoints may start attempts in; the rest is kept for "
        "endpoints that answer.",
    )
    slow_attempt_s: float = Field(
        2.0,
        gt=0,
        le=30,
        description="An endpoint whose answer takes this long, or whose attempt has waited this long, is slow.",
    )
    retry_schedule_s: Annotated[tuple[float, ...], NoDecode] = Field(
        (30.0, 120.0, 600.0, 1800.0, 7200.0, 21600.0),
        description="Retry step lengths in seconds; the last one repeats.",
    )
    retention_s: float = Field(259_200.0, gt=0, description="How long an event is retried before it is dead.")
    max_attempts: int | None = Field(
        None, ge=1, description="Attempts before an event is dead (none: retention only)."
    )
    retry_jitter: Literal["full", "none"] = Field(
        "full", description="full: each delay uniform in [0, step]."
    )
    retry_after_cap_s: float = Field(
        3600.0, ge=0, description="Longest delay a Retry-After header can ask for."
    )
    max_payload_bytes: int = Field(262_144, ge=1024, le=16 * 1024 * 1024)
    order_hold_s: float = Field(
        60.0,
        gt=0,
        description="Ordered endpoints: how long after it was due an earlier event still holds its subject back.",
    )
    consumer_check_s: float = Field(
        60.0,
        gt=0,
        description="How often each queue a dispatcher consumes is checked with the broker (a consumer the "
        "broker dropped without a cancel reaching the dispatcher is attached again).",
    )
    breaker_lease_s: float = Field(
        30.0,
        ge=10,
        description="An open breaker no health monitor renewed for this long is closed (monitors renew every 5 s).",
    )

    @field_validator("retry_schedule_s", mode="before")
    @classmethod
    def _parse_schedule(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                return tuple(float(part) for part in value.split(",") if part.strip())
            except ValueError:
                raise ValueError("must be comma-separated numbers of seconds") from None
        return value

    @field_validator("retry_schedule_s")
    @classmethod
    def _schedule_positive(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        if not value or any(step <= 0 for step in value):
            raise ValueError("must list at least one positive step")
        return value


class OutboxRelaySettings(CommonSettings):
    """``hookline outbox-relay``: publishes an upstream's outbox table (services/outbox-relay)."""

    outbox_dsn: SecretStr | None = Field(
        None,
        validate_default=True,
        description="The upstream's PostgreSQL (postgresql://user:password@host/db); or --dsn.",
    )
    outbox_batch_size: int = Field(
        500, ge=1, le=10_000, description="Rows one relay claims, publishes and marks sent at a time."
    )
    outbox_poll_s: float = Field(
        5.0,
        gt=0,
        description="Longest wait between looks at the table: NOTIFY wakes the relay at once, this is "
        "the safety net.",
    )
    outbox_retention_s: float = Field(
        86_400.0, ge=0, description="How long sent rows are kept before they are deleted (0: at once)."
    )
    outbox_lag_alert_s: float = Field(
        60.0, gt=0, description="The oldest unsent row older than this: the outbox_lagging alert."
    )
    outbox_metrics_host: str = "127.0.0.1"
    outbox_metrics_port: int = Field(8003, ge=0, le=65535, description="0 picks a free port.")
    metrics_token: MetricsToken = Field(
        None, description="A bearer token the metrics port's /metrics then requires (at least 16 characters)."
    )
    max_payload_bytes: int = Field(262_144, ge=1024, le=16 * 1024 * 1024)

    @field_validator("outbox_dsn")
    @classmethod
    def _postgres_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            raise ValueError("name the outbox's database: --dsn postgresql://user:password@host/db")
        if not value.get_secret_value().startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL")
        return value


class MonitorSettings(CommonSettings):
    api_token: ApiToken = Field(description="Bearer token for the status API (the same as the ingest's).")
    metrics_token: MetricsToken = Field(None, description=_METRICS_READER_DESCRIPTION)
    monitor_host: str = "127.0.0.1"
    monitor_port: int = Field(8001, ge=0, le=65535)
    breaker_failure_threshold: int = Field(10, ge=1, description="Consecutive failures that open a breaker.")
    breaker_cooldown_s: float = Field(
        300.0, gt=0, description="Open time before the first probe; doubles per failed probe."
    )
    breaker_max_cooldown_s: float = Field(3600.0, gt=0)
    breaker_slow_threshold: int = Field(
        3, ge=1, description="The threshold for endpoints whose p95 is over 5 s."
    )
    slow_p95_ms: float = Field(
        2000.0, gt=0, description="p95 over the last 5 minutes that flags an endpoint as slow."
    )
    very_slow_p95_ms: float = Field(
        5000.0, gt=0, description="p95 above which the breaker threshold is lowered."
    )
    disable_after_s: float = Field(
        259_200.0, gt=0, description="An endpoint whose breaker stays open this long is disabled."
    )
    oldest_pending_alert_s: float = Field(1800.0, gt=0)
    metrics_max_endpoints: int = Field(
        500, ge=0,
        description="Endpoints with series of their own in /metrics: those needing attention, the slowest, the busiest.",
    )  # fmt: skip
    tick_s: float = Field(1.0, gt=0, le=60, description="How often breakers and alerts are evaluated.")
    queue_poll_s: float = Field(
        5.0,
        gt=0,
        description="How often queue depths are read and missing queues and streams declared again.",
    )
    broker_poll_s: float = Field(
        10.0, gt=0, description="How often the broker's alarms, free disk and file handles are read."
    )
    broker_disk_headroom_bytes: int = Field(
        5_000_000_000,
        ge=0,
        description="Free disk above the broker's own limit under which broker_disk_low fires.",
    )
    broker_fd_ratio: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Share of the broker's file handles in use (or queues per handle) that fires an alert.",
    )
    canary_interval_s: float = Field(
        0.0,
        ge=0,
        description="A canary event every this many seconds to the canary tenant's endpoints (0: off).",
    )
    canary_tenant: str = Field("canary", description="The tenant canaries are published for.")
    canary_late_s: float = Field(
        60.0, gt=0, description="A canary not delivered within this fires canary_late."
    )
    alert_webhook_urls: str | None = Field(
        None,
        description="Operator alert sinks: [alerts=][slack+]URL, space or comma separated (README, Operations).",
    )
    alert_webhook_secret: SecretStr | None = Field(
        None, description="A whsec_ secret that signs what plain alert sinks receive."
    )
    retired_queue_grace_s: float = Field(
        300.0,
        gt=0,
        description="A queue an endpoint left (moved or deleted) is removed after staying empty this long.",
    )
    max_tracked_types: int = Field(
        1000,
        ge=1,
        description="Event types with statistics of their own (GET /v1/types/health); the others count "
        "together as the type (other).",
    )
    notifier_grace_s: float = Field(
        300.0,
        gt=0,
        description="A notifier no endpoint names any more (its notify_url changed or went) is removed "
        "after this long.",
    )
    ingest_url: str = Field(
        "http://127.0.0.1:8000",
        description="Where the dashboard (/ui/) reaches the ingest API, with the logged-in user's token.",
    )
    portal_frame_ancestors: str = Field(
        "",
        description="Origins that may show the customer portal in a frame, space separated "
        "(https://app.example.com); empty: none (the portal opens as a page of its own).",
    )
    portal_brand_name: str = Field("Webhooks", max_length=80, description="The portal's title.")
    portal_logo_url: str | None = Field(
        None, description="An https:// (or http://) image the portal shows beside its title."
    )
    portal_accent: str = Field(
        "#3867d6", pattern=r"^#[0-9a-fA-F]{6}$", description="The portal's accent colour, #rrggbb."
    )

    @field_validator("portal_frame_ancestors")
    @classmethod
    def _origins(cls, value: str) -> str:
        for origin in value.split():
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
                raise ValueError(f"{origin!r} is not an origin (scheme://host[:port])")
        return value

    @field_validator("portal_logo_url")
    @classmethod
    def _logo(cls, value: str | None) -> str | None:
        if value is not None and (
            urlsplit(value).scheme not in ("http", "https") or not urlsplit(value).netloc
        ):
            raise ValueError("must be an http:// or https:// URL")
        return value

    @field_validator("alert_webhook_secret")
    @classmethod
    def _whsec(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            signing.secret_key(value.get_secret_value())  # raises, naming what is wrong
        return value


def metrics_tokens(settings: IngestSettings | MonitorSettings) -> tuple[str, ...]:
    """What ``/metrics`` of the ingest or the monitor accepts: the admin token, which may read anything
    anyway, and the read-only metrics token when there is one (what Prometheus should hold)."""
    read_only = (settings.metrics_token.get_secret_value(),) if settings.metrics_token else ()
    return (settings.api_token.get_secret_value(), *read_only)


class ClientSettings(BaseSettings):
    """What the ``hookline`` admin commands need to reach the APIs."""

    model_config = SettingsConfigDict(env_prefix="HOOKLINE_", extra="ignore", frozen=True)

    api_token: SecretStr | None = None
    ingest_url: str = "http://127.0.0.1:8000"
    monitor_url: str = "http://127.0.0.1:8001"


SettingsT = TypeVar("SettingsT", bound=BaseSettings)


def load(cls: type[SettingsT], **given: Any) -> SettingsT:
    """Build settings from the environment (``given``: command-line values, which win), or exit with one
    line naming each bad variable."""
    try:
        return cls(**given)
    except ValidationError as exc:
        prefix = cls.model_config.get("env_prefix", "")
        for error in exc.errors():
            name = prefix + "_".join(str(part) for part in error["loc"][:1]).upper()
            print(f"hookline: invalid setting {name}: {error['msg']}", file=sys.stderr)
        raise SystemExit(2) from None
