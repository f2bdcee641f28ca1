"""The outbox relay's Prometheus metrics (served by :mod:`hookline.shared.runtime.probes`)."""

from __future__ import annotations

import prometheus_client

PUBLISHED = prometheus_client.Counter(
    "hookline_outbox_published_rows", "Outbox rows published to events and confirmed by the broker."
)
REFUSED = prometheus_client.Counter(
    "hookline_outbox_refused_rows", "Outbox rows that make no valid event (their error column says why)."
)
DELETED = prometheus_client.Counter(
    "hookline_outbox_deleted_rows", "Sent rows deleted after HOOKLINE_OUTBOX_RETENTION_S."
)
HELD_BACK = prometheus_client.Counter(
    "hookline_outbox_held_back_rows",
    "Claimed rows left for later: an earlier row of their subject was not published yet.",
)
LAG_SECONDS = prometheus_client.Gauge(
    "hookline_outbox_lag_seconds", "Age of the oldest unsent row (0 when none waits)."
)
PENDING_ROWS = prometheus_client.Gauge("hookline_outbox_pending_rows", "Rows waiting to be published.")
FAILED_ROWS = prometheus_client.Gauge(
    "hookline_outbox_failed_rows", "Rows refused and kept, unsent, until someone fixes them."
)
BATCH_SECONDS = prometheus_client.Histogram(
    "hookline_outbox_batch_seconds",
    "A batch from claim to commit (publishing and the confirms included).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
