"""An event screened by its endpoints' filters (:mod:`hookline.shared.outbound.filters`) where it is fanned out,
so that an endpoint whose filter it does not match gets no copy of its own: no queue write, no delivery.
The event's CEL variables are built once per event, only when one of its endpoints has a filter, and
hold only what those filters read (:class:`filters.Needs`)."""

from __future__ import annotations

from collections.abc import Sequence

import cel
import structlog

from hookline.dispatcher import metrics
from hookline.shared.contracts.models import Event, StoredEndpoint
from hookline.shared.outbound import filters

log = structlog.get_logger(__name__)


def admitted(event: Event, endpoints: Sequence[StoredEndpoint]) -> Sequence[StoredEndpoint]:
    """The endpoints among ``endpoints`` whose filter (if any) ``event`` matches."""
    screened = [endpoint for endpoint in endpoints if endpoint.filter is not None]
    if not screened:
        return endpoints
    variables = _context(event, screened)
    refused = set()
    for endpoint in screened:
        assert endpoint.filter is not None
        verdict = filters.verdict(endpoint.filter, variables)
        if verdict.error is not None:
            metrics.FILTER_ERRORS.labels(endpoint.id).inc()
            log.info("filter_error", endpoint_id=endpoint.id, event_id=event.id, error=verdict.error)
        if not verdict.matches:
            refused.add(endpoint.id)
    if not refused:
        return endpoints
    metrics.FILTERED.inc(len(refused))
    return [endpoint for endpoint in endpoints if endpoint.id not in refused]


def _context(event: Event, screened: Sequence[StoredEndpoint]) -> cel.Context:
    variables: set[str] = set()
    data_keys: set[str] | None = set()
    for endpoint in screened:
        assert endpoint.filter is not None
        needs = _needs(endpoint.filter)
        variables.update(needs.variables)
        if needs.data_keys is None:
            data_keys = None
        elif data_keys is not None:
            data_keys.update(needs.data_keys)
    return filters.context(
        {
            "type": event.type, "tenant": event.tenant, "subject": event.subject,
            "schema_version": event.schema_version, "occurred_at": event.occurred_at.isoformat(),
            "sequence": event.sequence, "data": event.data,
        },
        filters.Needs(frozenset(variables), None if data_keys is None else frozenset(data_keys)),
    )  # fmt: skip


def _needs(source: str) -> filters.Needs:
    try:
        return filters.compiled(source).needs
    except filters.FilterError:  # no match, said by its verdict; it reads nothing
        return filters.NOTHING
