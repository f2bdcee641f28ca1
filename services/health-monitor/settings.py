"""The health monitor's settings (``HOOKLINE_*``), read once at its start; the fields every service
shares are :class:`~hookline.shared.runtime.settings.CommonSettings`.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator

from hookline.shared.outbound import signing
from hookline.shared.runtime.settings import (
    METRICS_READER_DESCRIPTION,
    ApiToken,
    CommonSettings,
    MetricsToken,
)


class MonitorSettings(CommonSettings):
    api_token: ApiToken = Field(description="Bearer token for the status API (the same as the ingest's).")
    metrics_token: MetricsToken = Field(None, description=METRICS_READER_DESCRIPTION)
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
