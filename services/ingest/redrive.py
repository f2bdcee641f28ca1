"""``/v1/dead-letters``: list dead letters with filters, and redrive them into their endpoint's queue.

The ingest follows the stream ``hookline.dead-letters`` into an in-memory index of the facts (not the
bodies); a redrive reads the bodies back from the stream, resends them, then appends a record naming
what it redrove, so that every ingest replica stops listing them.
"""

from __future__ import annotations

from typing import Annotated, Self

import aio_pika
import orjson
import structlog
from fastapi import APIRouter, Query
from pydantic import Field, model_validator

from hookline.ingest.auth import Caller
from hookline.ingest.resend import Resend, resend
from hookline.ingest.state import DeadLetters, IngestState, State
from hookline.shared.broker import topology
from hookline.shared.broker.streams import Record, read_until_now
from hookline.shared.contracts.deadletters import REDRIVEN_HEADER, DeadLetterItem, item_id, offset_of
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import DeadLetterReason, Model, StoredEndpoint
from hookline.shared.outbound import filters
from hookline.shared.state.registry import EndpointRegistry

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/v1/dead-letters", tags=["dead letters"])


class DeadLetterList(Model):
    data: list[DeadLetterItem]
    next_after: str | None = Field(None, description="pass as ?after= for the next page; null on the last")


class RedriveRequest(Model):
    """Which dead letters to redrive: every filter given must match; ``all`` redrives everything."""

    endpoint_id: str | None = None
    tenant: str | None = None
    reason: DeadLetterReason | None = None
    event_id: str | None = None
    ids: list[str] | None = Field(None, max_length=10_000)
    all: bool = False

    @model_validator(mode="after")
    def _something_chosen(self) -> Self:
        chosen = any(
            v is not None for v in (self.endpoint_id, self.tenant, self.reason, self.event_id, self.ids)
        )
        if not chosen and not self.all:
            raise ValueError(
                "choose what to redrive (endpoint_id, tenant, reason, event_id, ids) or set all: true"
            )
        return self


class RedriveResult(Model):
    redriven: int
    skipped: int = Field(description="invalid events, and those whose endpoint no longer exists")


def _tenant_of(registry: EndpointRegistry, endpoint_id: str | None) -> str | None:
    """The tenant an admin's redrive of one endpoint is about (its trail is the tenant's too)."""
    endpoint = registry.deletions.last_known(endpoint_id) if endpoint_id else None
    return endpoint.tenant if endpoint is not None else None


async def _bodies(state: IngestState, wanted: set[str]) -> dict[str, bytes]:
    """The messages of the dead letters ``wanted`` (by id), read from the stream that keeps them."""
    bodies: dict[str, bytes] = {}

    def collect(message: Record) -> None:
        offset = (message.headers or {}).get("x-stream-offset")
        if isinstance(offset, int) and item_id(offset) in wanted:
            bodies[item_id(offset)] = message.body

    await read_until_now(
        state.broker,
        state.publisher,
        topology.DEAD_LETTER_STREAM,
        collect,
        start=min(offset_of(dead_letter_id) or 0 for dead_letter_id in wanted),
        timeout_s=state.settings.registry_wait_s,
    )
    return bodies


def _admitted(endpoint: StoredEndpoint | None, body: bytes) -> bool:
    if endpoint is None or endpoint.filter is None:
        return True
    try:
        event = orjson.loads(body)
    except orjson.JSONDecodeError:
        return True  # not an event: dead again with its reason, as any invalid body redriven
    return isinstance(event, dict) and filters.admits(endpoint.filter, event)


@router.get("", response_model=DeadLetterList)
async def list_dead_letters(
    dead_letters: DeadLetters,
    caller: Caller,
    endpoint_id: str | None = None,
    tenant: str | None = None,
    reason: DeadLetterReason | None = None,
    event_id: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[str | None, Query(description="return dead letters after this id")] = None,
) -> DeadLetterList:
    selected = await dead_letters.select(
        endpoint_id=endpoint_id,
        tenant=caller.scope(tenant),
        reason=reason,
        event_id=event_id,
        after=after,
        limit=limit + 1,
    )
    page = selected[:limit]
    return DeadLetterList(
        data=[item for item in page if caller.sees_endpoint(item.endpoint_id)],
        next_after=page[-1].id if len(selected) > limit else None,
    )


@router.post("/redrive", response_model=RedriveResult)
async def redrive(request: RedriveRequest, state: State, caller: Caller) -> RedriveResult:
    chosen = await state.dead_letters_index.select(
        endpoint_id=request.endpoint_id,
        tenant=caller.scope(request.tenant),
        reason=request.reason,
        event_id=request.event_id,
        ids=set(request.ids) if request.ids is not None else None,
    )
    # An invalid event would only die again; an endpoint that is gone has no queue to go back to.
    wanted = {
        item.id: item
        for item in chosen
        if item.reason is not DeadLetterReason.INVALID_EVENT
        and caller.sees_endpoint(item.endpoint_id)
        and item.event_id
        and item.endpoint_id
        and state.registry.get(item.endpoint_id) is not None
    }
    if not wanted:
        return RedriveResult(redriven=0, skipped=len(chosen))
    bodies = await _bodies(state, set(wanted))
    # The endpoint's filter as it is now decides too (one changed since: what it no longer wants stays).
    items = [
        wanted[dead_letter_id]
        for dead_letter_id in wanted
        if dead_letter_id in bodies
        and _admitted(state.registry.get(wanted[dead_letter_id].endpoint_id or ""), bodies[dead_letter_id])
    ]
    sent = await resend(
        state.registry,
        state.publisher,
        state.isolation,
        (
            Resend(item.endpoint_id or "", item.event_id or "", bodies[item.id], origin="redrive")
            for item in items
        ),
    )
    # Recorded after the resend: a crash in between redelivers twice rather than never.
    await state.dead_letters_log.append(
        aio_pika.Message(
            orjson.dumps({"ids": [item.id for item in items]}),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=new_id("redrive"),
            headers={REDRIVEN_HEADER: len(items)},
        ),
        timeout_s=state.settings.registry_wait_s,
    )
    log.info("dead_letters_redriven", count=sent, skipped=len(chosen) - sent, endpoint_id=request.endpoint_id)
    await state.trail.record(
        caller, "dead_letters.redriven",
        tenant=caller.scope(request.tenant) or _tenant_of(state.registry, request.endpoint_id),
        target=request.endpoint_id,
        changes={"filter": request.model_dump(mode="json", exclude_none=True), "redriven": sent},
    )  # fmt: skip
    return RedriveResult(redriven=sent, skipped=len(chosen) - sent)
