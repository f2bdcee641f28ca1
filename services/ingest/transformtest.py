"""Trying a transform before relying on it: ``POST /v1/transforms/test {"transform", "event"}`` →
``{"output"}`` (the body an endpoint with it would be sent) or ``{"error"}`` (why none would be: the
copy would be a ``transform_failed`` dead letter), run as deliveries run it: in a worker process, with
the same time and size limits (:mod:`hookline.shared.outbound.transforms`). Nothing is sent."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter

from hookline.ingest.schemas import EndpointTransform
from hookline.ingest.state import State
from hookline.shared.contracts.models import Model
from hookline.shared.outbound.transforms import TransformFailedError

router = APIRouter(tags=["transforms"])


class TransformTest(Model):
    transform: EndpointTransform
    event: dict[str, Any]  # an event as published (id, type, tenant, data, ...)


class TransformResult(Model):
    output: Any = None  # the body that would be sent, as JSON
    error: str | None = None


@router.post("/v1/transforms/test", response_model=TransformResult)
async def test_transform(spec: TransformTest, state: State) -> TransformResult:
    try:
        body = await state.attempts.transformer.apply(spec.transform, orjson.dumps(spec.event))
    except TransformFailedError as exc:
        return TransformResult(error=str(exc))
    return TransformResult(output=orjson.loads(body))
