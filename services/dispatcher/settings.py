"""The dispatcher's settings (``HOOKLINE_*``), read once at its start; the fields every service shares are
:class:`~hookline.shared.runtime.settings.CommonSettings`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from hookline.shared.runtime.settings import (
    DeliveryPolicySettings,
    MetricsToken,
)


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
