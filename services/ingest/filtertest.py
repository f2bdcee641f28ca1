"""Trying a filter before relying on it: ``POST /v1/filters/test {"filter", "event" | "event_id"}`` and
``POST /v1/endpoints/{id}/filter/test {"filter"?, "event" | "event_id"}`` (the endpoint's current
filter unless one is given) → ``{"matches", "error"}``, as the dispatchers would decide
(:mod:`hookline.shared.outbound.filters`, one definition). ``event_id`` names a recent event, read back from the
event log (the dashboard's and the portal's "try it on a recent event"). Nothing is sent."""

from __future__ import annotations

from typing import Any, Self

import orjson
from fastapi import APIRouter
from pydantic import Field, model_validator

from hookline.ingest.auth import Caller, Principal
from hookline.ingest.schemas import EndpointFilter
from hookline.ingest.state import IngestState, State
from hookline.shared.broker import topology
from hookline.shared.broker.streams import read_at
from hookline.shared.contracts.models import Model
from hookline.shared.outbound import filters
from hookline.shared.runtime.api import ApiError

router = APIRouter(tags=["filters"])
READ_TIMEOUT_S = 10.0


class _OnEvent(Model):
    event: dict[str, Any] | None = Field(None, description="an event as published (type, tenant, data, ...)")
    event_id: str | None = Field(None, max_length=128, description="or a recent event's id")

    @model_validator(mode="after")
    def _one_event(self) -> Self:
        if (self.event is None) == (self.event_id is None):
            raise ValueError("give the event, or the id of a recent one (event_id), not both")
        return self


class FilterTest(_OnEvent):
    filter: EndpointFilter


class EndpointFilterTest(_OnEvent):
    filter: EndpointFilter | None = Field(None, description="try this instead of the endpoint's own")


class FilterVerdict(Model):
    matches: bool
    error: str | None = None  # why it could not be evaluated: counted as no match


@router.post("/v1/filters/test", response_model=FilterVerdict)
async def test_filter(spec: FilterTest, state: State, caller: Caller) -> FilterVerdict:
    return _verdict(spec.filter, await _event(state, caller, spec))


@router.post("/v1/endpoints/{endpoint_id}/filter/test", response_model=FilterVerdict)
async def test_endpoint_filter(
    endpoint_id: str, spec: EndpointFilterTest, state: State, caller: Caller
) -> FilterVerdict:
    endpoint = caller.endpoint(state.registry, endpoint_id)
    source = spec.filter or endpoint.filter
    if source is None:
        return FilterVerdict(matches=True)  # no filter: every event its patterns match
    return _verdict(source, await _event(state, caller, spec))


async def _event(state: IngestState, caller: Principal, spec: _OnEvent) -> dict[str, Any]:
    if spec.event is not None:
        return spec.event
    assert spec.event_id is not None
    logged = await state.delivery_log.event(spec.event_id)
    body = None
    if logged is not None and caller.may_see(logged.tenant):
        body = await read_at(state.broker, topology.EVENT_LOG, logged.offset, timeout_s=READ_TIMEOUT_S)
    if body is None:
        raise ApiError(
            404, "not_found", f"no event {spec.event_id} in the delivery log (kept for its retention)"
        )
    event: dict[str, Any] = orjson.loads(body)
    return event


def _verdict(source: str, event: dict[str, Any]) -> FilterVerdict:
    verdict = filters.verdict(source, filters.context(event))
    return FilterVerdict(matches=verdict.matches, error=verdict.error)
