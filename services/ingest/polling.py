"""Polling endpoints (``"kind": "polling"``): for customers that cannot accept inbound HTTP, the events
an endpoint subscribes to are fetched, ``GET /v1/endpoints/{id}/poll?iterator=&limit=``, with the
endpoint's own ``poll_token`` (shown once, at creation; stored as a digest; not the signing secret).

Nothing is queued for a polling endpoint: the fan-out passes it over, its patterns bind nothing. A poll
is answered from this ingest's delivery log, which records every event's place in the event log, and the
bodies are read back from that stream: the tenant's events matching the endpoint's patterns after the
iterator, in the order they were accepted, each signed as a push endpoint's delivery would be (verify
``body`` with the ``headers``, as the receiver library does). An event fetched is recorded as an attempt
of kind ``poll``: the delivery log shows it delivered. What the endpoint did not fetch within its
``retention_s`` (or the event log kept no longer) is counted in ``expired``, not returned.

The iterator is an event-log position. Views apply the log in order, so an ingest whose view is behind
returns fewer events, never skips one: ``next_iterator`` never moves back, and what a lagging replica
has not read yet comes with a later poll."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from datetime import UTC, datetime
from typing import Annotated

import orjson
import structlog
from fastapi import APIRouter, Header, Query

from hookline.ingest.attempts import ATTEMPTER_ID, signing_keys
from hookline.ingest.auth import Caller
from hookline.ingest.deliverylog import LoggedEvent
from hookline.ingest.state import IngestState, State
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import BROKER_ERRORS
from hookline.shared.broker.streams import read_many
from hookline.shared.contracts.models import Model, StoredEndpoint
from hookline.shared.contracts.telemetry import AttemptRecord, Outcome
from hookline.shared.contracts.webhook import webhook_request
from hookline.shared.outbound import filters
from hookline.shared.runtime.api import ApiError, broker_unavailable

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/v1/endpoints", tags=["polling"])  # the poll route: its own credential
admin_router = APIRouter(prefix="/v1/endpoints", tags=["polling"])  # behind the API's tokens

TOKEN_PREFIX = "hlpt_"  # noqa: S105 - a prefix, not a secret
ITERATOR = r"^o-?[0-9]{1,18}$"
#: Rows of the tenant's events one poll looks through: a tenant whose other event types outnumber the
#: endpoint's cannot make a poll slow; it returns an iterator past them and ``done: false``.
SCAN_ROWS = 2_000
#: How long an unfetched event waits when the endpoint sets no ``retention_s`` (as a push endpoint's
#: retries: HOOKLINE_RETENTION_S's default).
DEFAULT_RETENTION_S = 259_200.0
READ_TIMEOUT_S = 10.0
UNAUTHORIZED = "this route takes a polling endpoint's poll_token: Authorization: Bearer hlpt_…"


def refuse_if_polling(endpoint: StoredEndpoint, what: str) -> None:
    """422 for what only an endpoint hookline pushes to can do (a polling endpoint fetches instead)."""
    if endpoint.polling:
        raise ApiError(
            422, "polling_endpoint", f"{endpoint.id} is a polling endpoint: {what} applies to push endpoints"
        )


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class RotatedPollToken(Model):
    poll_token: str  # shown this once; the previous token stops working at once


@admin_router.post("/{endpoint_id}/rotate-poll-token", response_model=RotatedPollToken)
async def rotate_poll_token(endpoint_id: str, state: State, caller: Caller) -> RotatedPollToken:
    """A new poll token for a polling endpoint, the old one void from now (a leaked token is revoked, not
    overlapped: unlike a signing secret, nothing signed with it is in flight)."""
    endpoint = caller.endpoint(state.registry, endpoint_id)
    if not endpoint.polling:
        raise ApiError(422, "not_polling", f"{endpoint_id} is a push endpoint: it has no poll token")
    token = new_token()

    def rotated(current: StoredEndpoint) -> StoredEndpoint | None:
        now = datetime.now(UTC)
        return current.model_copy(update={"poll_token_hash": token_hash(token), "updated_at": now})

    written = await state.change_log.update(endpoint.id, rotated, timeout_s=state.settings.registry_wait_s)
    if written is None:
        raise ApiError(404, "not_found", "the endpoint was deleted meanwhile")
    log.info("endpoint_poll_token_rotated", endpoint_id=endpoint.id, tenant=endpoint.tenant)
    await state.trail.record(
        caller, "endpoint.poll_token_rotated", tenant=endpoint.tenant, target=endpoint.id,
        changes={"poll_token_hash": "changed"},
    )  # fmt: skip
    return RotatedPollToken(poll_token=token)


class PolledEvent(Model):
    id: str
    type: str
    headers: dict[str, str]  # webhook-id, webhook-timestamp, webhook-signature: as a push would carry
    body: str  # the event, exactly as signed


class PollPage(Model):
    data: list[PolledEvent]
    next_iterator: str  # pass it as ``iterator`` next time
    done: bool  # nothing more to fetch after next_iterator, for now
    expired: int  # events skipped: older than the endpoint's retention_s when this poll reached them


def _authorized(state: IngestState, endpoint_id: str, authorization: str | None) -> StoredEndpoint:
    scheme, _, presented = (authorization or "").partition(" ")
    endpoint = state.registry.get(endpoint_id)
    expected = endpoint.poll_token_hash if endpoint is not None else None
    # The digest is compared whether or not the endpoint exists: the answer's time says nothing of it.
    matches = hmac.compare_digest(token_hash(presented.strip()), expected or "0" * 64)
    if endpoint is None or expected is None or scheme.lower() != "bearer" or not matches:
        raise ApiError(401, "unauthorized", UNAUTHORIZED)
    return endpoint


@router.get("/{endpoint_id}/poll", response_model=PollPage)
async def poll(
    endpoint_id: str,
    state: State,
    authorization: Annotated[str | None, Header()] = None,
    iterator: Annotated[
        str | None, Query(pattern=ITERATOR, description="next_iterator of the last poll")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=250)] = 50,
) -> PollPage:
    endpoint = _authorized(state, endpoint_id, authorization)
    after = int(iterator[1:]) if iterator else -1
    rows = await state.delivery_log.events_after(endpoint.tenant, after_offset=after, limit=SCAN_ROWS)
    now_s = time.time()
    oldest_s = now_s - (endpoint.retention_s or DEFAULT_RETENTION_S)
    created_s = endpoint.created_at.timestamp()
    chosen: list[LoggedEvent] = []
    expired = 0
    last = after
    for row in rows:
        if len(chosen) == limit:
            break
        last = row.offset
        if row.accepted_at_s < created_s or not any(
            topology.topic_matches(pattern, row.type) for pattern in endpoint.event_types
        ):
            continue
        if row.accepted_at_s < oldest_s:
            expired += 1
            continue
        chosen.append(row)
    try:
        bodies = await _bodies(state, [row.offset for row in chosen])
    except BROKER_ERRORS:  # TimeoutError among them
        raise broker_unavailable(
            "the event log cannot be read now; poll again with the same iterator"
        ) from None
    keys = signing_keys(state.sealer, endpoint, datetime.now(UTC))
    polled = []
    for row, body in zip(chosen, bodies, strict=True):
        if body is None:  # the event log's retention removed it meanwhile
            expired += 1
            continue
        if endpoint.filter is not None and not filters.admits(endpoint.filter, orjson.loads(body)):
            continue  # the iterator moves past it: never fetched, and the delivery log says filtered
        request = webhook_request(endpoint, keys, row.event_id, body, timestamp_s=int(now_s))
        polled.append(
            PolledEvent(id=row.event_id, type=row.type, headers=request.headers, body=request.body.decode())
        )
    await _record(state, endpoint, polled, started_s=now_s)
    done = len(rows) < SCAN_ROWS and len(chosen) < limit
    log.info(
        "endpoint_polled",
        endpoint_id=endpoint.id,
        tenant=endpoint.tenant,
        events=len(polled),
        expired=expired,
    )
    return PollPage(data=polled, next_iterator=f"o{max(last, after)}", done=done, expired=expired)


async def _bodies(state: IngestState, offsets: list[int]) -> list[bytes | None]:
    found = await read_many(state.broker, topology.EVENT_LOG, offsets, timeout_s=READ_TIMEOUT_S)
    return [found.get(offset) for offset in offsets]


async def _record(
    state: IngestState, endpoint: StoredEndpoint, polled: list[PolledEvent], *, started_s: float
) -> None:
    """Each event fetched, as a successful attempt of kind ``poll`` (the delivery log's "delivered")."""
    if not polled:
        return
    ended_s = time.time()
    records = [
        AttemptRecord(
            at_s=ended_s,
            dispatcher_id=ATTEMPTER_ID,
            event_id=event.id,
            endpoint_id=endpoint.id,
            tenant=endpoint.tenant,
            type=event.type,
            attempt=1,
            outcome=Outcome.SUCCESS,
            status=200,
            error=None,
            duration_ms=(ended_s - started_s) * 1000,
            first_attempt_at_s=started_s,
            attempt_kind="poll",
        )
        for event in polled
    ]
    if not await state.attempts.record(records):
        log.warning("attempt_record_held", endpoint_id=endpoint.id, kind="poll", events=len(records))
