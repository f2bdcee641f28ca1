"""Settings, read once from ``HOOKLINE_*`` environment variables at a service's start and passed down.

Each service has its own class, in the service (``hookline.ingest.settings`` and so on), so that a
dispatcher never needs the API token and the ingest never needs a metrics port; the fields they share
live here in :class:`CommonSettings`, and the rules two services apply alike (tokens, delivery policy). A bad value stops the
service with one line naming the variable (:func:`load`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, TypeVar
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from hookline.shared.broker.topology import Retention
from hookline.shared.outbound import sealing

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
METRICS_READER_DESCRIPTION = (
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


class ServesAnApi(Protocol):
    """Settings of a service with an admin API and ``/metrics`` (the ingest, the monitor)."""

    @property
    def api_token(self) -> SecretStr: ...
    @property
    def metrics_token(self) -> SecretStr | None: ...


def metrics_tokens(settings: ServesAnApi) -> tuple[str, ...]:
    """What ``/metrics`` of the ingest or the monitor accepts: the admin token, which may read anything
    anyway, and the read-only metrics token when there is one (what Prometheus should hold)."""
    read_only = (settings.metrics_token.get_secret_value(),) if settings.metrics_token else ()
    return (settings.api_token.get_secret_value(), *read_only)


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
