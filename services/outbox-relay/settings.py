"""The outbox relay's settings (``HOOKLINE_*``), read once at its start; the fields every service shares
are :class:`~hookline.shared.runtime.settings.CommonSettings`.
"""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator

from hookline.shared.runtime.settings import (
    CommonSettings,
    MetricsToken,
)


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
