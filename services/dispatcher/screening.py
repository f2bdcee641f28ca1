"""An event screened by its endpoints' filters (:mod:`hookline.shared.filters`) where it is fanned out,
so that an endpoint whose filter it does not match gets no copy of its own: no queue write, no delivery.
The event's CEL variables are built once per event, and only when one of its endpoints has a filter."""

from __future__ import annotations

import cel
import structlog

from hookline.dispatcher import metrics
from hookline.shared import filters
from hookline.shared.models import Event, StoredEndpoint

log = structlog.get_logger(__name__)


class Screen:
    __slots__ = ("_context", "_event")

    def __init__(self, event: Event) -> None:
        self._event = event
        self._context: cel.Context | None = None

    def admits(self, endpoint: StoredEndpoint) -> bool:
        if endpoint.filter is None:
            return True
        if self._context is None:
            event = self._event
            self._context = filters.context(
                {
                    "type": event.type, "tenant": event.tenant, "subject": event.subject,
                    "schema_version": event.schema_version, "occurred_at": event.occurred_at.isoformat(),
                    "sequence": event.sequence, "data": event.data,
                }
            )  # fmt: skip
        verdict = filters.verdict(endpoint.filter, self._context)
        if verdict.error is not None:
            metrics.FILTER_ERRORS.labels(endpoint.id).inc()
            log.info("filter_error", endpoint_id=endpoint.id, event_id=self._event.id, error=verdict.error)
        if not verdict.matches:
            metrics.FILTERED.inc()
        return verdict.matches
