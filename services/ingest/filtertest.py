"""Trying a filter before relying on it: ``POST /v1/filters/test {"filter", "event"}`` and ``POST
/v1/endpoints/{id}/filter/test {"event"}`` (the endpoint's current filter) → ``{"matches", "error"}``,
as the dispatchers would decide (:mod:`hookline.shared.filters`, one definition). Nothing is sent."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from hookline.ingest.auth import Caller
from hookline.ingest.schemas import EndpointFilter
from hookline.ingest.state import Registry
from hookline.shared import filters
from hookline.shared.api import ApiError
from hookline.shared.models import Model

router = APIRouter(tags=["filters"])


class FilterTest(Model):
    filter: EndpointFilter
    event: dict[str, Any]  # an event as published (type, tenant, subject, data, ...), or a recent one


class EndpointFilterTest(Model):
    event: dict[str, Any]


class FilterVerdict(Model):
    matches: bool
    error: str | None = None  # why it could not be evaluated: counted as no match


@router.post("/v1/filters/test", response_model=FilterVerdict)
async def test_filter(spec: FilterTest) -> FilterVerdict:
    return _verdict(spec.filter, spec.event)


@router.post("/v1/endpoints/{endpoint_id}/filter/test", response_model=FilterVerdict)
async def test_endpoint_filter(
    endpoint_id: str, spec: EndpointFilterTest, registry: Registry, caller: Caller
) -> FilterVerdict:
    endpoint = registry.get(endpoint_id)
    if endpoint is None or not caller.may_see(endpoint.tenant):
        raise ApiError(404, "not_found", f"no endpoint {endpoint_id}")
    if endpoint.filter is None:
        return FilterVerdict(matches=True)  # no filter: every event its patterns match
    return _verdict(endpoint.filter, spec.event)


def _verdict(source: str, event: dict[str, Any]) -> FilterVerdict:
    verdict = filters.verdict(source, filters.context(event))
    return FilterVerdict(matches=verdict.matches, error=verdict.error)
