"""The ingest's settings (``HOOKLINE_*``), read once at its start; the fields every service shares are
:class:`~hookline.shared.runtime.settings.CommonSettings`.
"""

from __future__ import annotations

from pydantic import Field, SecretStr, ValidationInfo, field_validator

from hookline.shared.runtime.settings import (
    METRICS_READER_DESCRIPTION,
    ApiToken,
    DeliveryPolicySettings,
    MetricsToken,
)


class IngestSettings(DeliveryPolicySettings):
    api_token: ApiToken = Field(description="Admin bearer token for the HTTP API (at least 16 characters).")
    metrics_token: MetricsToken = Field(None, description=METRICS_READER_DESCRIPTION)
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
