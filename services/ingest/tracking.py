""" "Where is my event?": an event's story at every endpoint, recent events, an endpoint's attempts, and
one more attempt by hand. Tenant-scoped like every route: another tenant's event is a 404."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated

import cel
import orjson
import structlog
from fastapi import APIRouter, Query
from pydantic import BaseModel, ValidationError

from hookline.ingest import polling
from hookline.ingest.auth import Caller, Principal
from hookline.ingest.deliverylog import LoggedEvent
from hookline.ingest.state import IngestState, State
from hookline.ingest.timeline import filtered_out, standing
from hookline.shared.broker import topology
from hookline.shared.broker.streams import read_at
from hookline.shared.contracts.models import Event, EventState, Model, StoredEndpoint
from hookline.shared.contracts.telemetry import AttemptKind, AttemptRecord
from hookline.shared.outbound import filters
from hookline.shared.outbound.sealing import RESPONSE_PURPOSE, SealedSecretError, Sealer
from hookline.shared.runtime.api import ApiError

log = structlog.get_logger(__name__)
router = APIRouter(tags=["delivery log"])

READ_TIMEOUT_S = 10.0
CURSOR = r"^o[0-9]{1,18}$"  # what next_after looks like: "o" and a position in a view


class AttemptView(Model):
    attempt: int
    kind: AttemptKind
    at: datetime
    status: int | None
    outcome: str
    error: str | None
    duration_ms: float
    dns_ms: float | None
    connect_ms: float | None  # TLS included
    first_byte_ms: float | None
    dispatcher_id: str
    next_attempt_at: datetime | None
    dead_letter_reason: str | None
    response_headers: dict[str, str]
    response_body: str | None  # the start of it (HOOKLINE_RESPONSE_CAPTURE_BYTES)


class EndpointCourse(Model):
    endpoint_id: str
    state: EventState
    attempts: list[AttemptView]
    next_attempt_at: datetime | None
    waiting_reason: str | None


class EventStory(Model):
    id: str
    tenant: str
    type: str
    subject: str | None
    accepted_at: datetime
    endpoints: list[EndpointCourse]


class EventPage(Model):
    data: list[EventStory]
    next_after: str | None  # pass as ``after`` for the next (older) page


class EndpointAttempt(AttemptView):
    event_id: str
    endpoint_id: str


class AttemptPage(Model):
    data: list[EndpointAttempt]
    next_after: str | None


class ResendRequest(BaseModel):
    endpoint_id: str


@router.get("/v1/events/{event_id}", response_model=EventStory)
async def event_story(event_id: str, state: State, caller: Caller) -> EventStory:
    logged = await state.delivery_log.event(event_id)
    if logged is None or not caller.may_see(logged.tenant):
        raise ApiError(404, "not_found", f"no event {event_id} in the delivery log (kept for its retention)")
    return _seen(await _story(state, logged), caller)


def _seen(story: EventStory, caller: Principal) -> EventStory:
    """The story as the caller may see it: a portal session limited to some endpoints, theirs only."""
    courses = [course for course in story.endpoints if caller.sees_endpoint(course.endpoint_id)]
    return story if len(courses) == len(story.endpoints) else story.model_copy(update={"endpoints": courses})


@router.get("/v1/events", response_model=EventPage)
async def recent_events(
    state: State,
    caller: Caller,
    tenant: str | None = None,
    type: str | None = None,
    subject: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    event_state: Annotated[EventState | None, Query(alias="state")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    after: Annotated[str | None, Query(description="next_after of the previous page", pattern=CURSOR)] = None,
) -> EventPage:
    """Newest first. With ``state``, the events in that state at one of their endpoints at least."""
    before = _cursor(after)
    stories: list[EventStory] = []
    # A state filter is applied to the stories: read on, a page at a time, until the page is full.
    for _ in range(20):
        page = await state.delivery_log.recent_events(
            tenant=caller.scope(tenant), type=type, subject=subject,
            since_s=since.timestamp() if since else None, until_s=until.timestamp() if until else None,
            before_offset=before, limit=limit,
        )  # fmt: skip
        for logged in page:
            story = _seen(await _story(state, logged, with_attempts=False), caller)
            # A portal session limited to some endpoints skips the events for none of them.
            hidden = not story.endpoints and not caller.sees_endpoint(None)
            if not hidden and (
                event_state is None or any(course.state == event_state for course in story.endpoints)
            ):
                stories.append(story)
            before = logged.offset
            if len(stories) == limit:
                return EventPage(data=stories, next_after=f"o{before}")
        if len(page) < limit:
            return EventPage(data=stories, next_after=None)
    return EventPage(data=stories, next_after=f"o{before}")


@router.get("/v1/endpoints/{endpoint_id}/attempts", response_model=AttemptPage)
async def endpoint_attempts(
    endpoint_id: str,
    state: State,
    caller: Caller,
    outcome: str | None = None,
    since: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    after: Annotated[str | None, Query(description="next_after of the previous page", pattern=CURSOR)] = None,
) -> AttemptPage:
    """Newest first."""
    endpoint = state.registry.deletions.last_known(endpoint_id)
    if endpoint is None or not caller.may_see(endpoint.tenant):
        raise ApiError(404, "not_found", f"no endpoint {endpoint_id}")
    rows = await state.delivery_log.attempts_of_endpoint(
        endpoint_id, outcome=outcome, since_s=since.timestamp() if since else None,
        before_id=_cursor(after), limit=limit + 1,
    )  # fmt: skip
    page = rows[:limit]
    return AttemptPage(
        data=[
            EndpointAttempt(
                event_id=r.event_id, endpoint_id=r.endpoint_id, **attempt_view(state.sealer, r).model_dump()
            )
            for _, r in page
        ],
        next_after=f"o{page[-1][0]}" if len(rows) > limit else None,
    )


@router.post("/v1/events/{event_id}/resend", status_code=202, response_model=EndpointAttempt)
async def resend_event(
    event_id: str, request: ResendRequest, state: State, caller: Caller
) -> EndpointAttempt:
    """One attempt now, by the ingest, signed with the same ``webhook-id``, whatever the event's state
    (a delivered one too: "send it again"). It is beside the event's course: no retry follows it, the
    retry budget is untouched, and the breaker and statistics ignore it; the delivery log keeps it."""
    logged = await state.delivery_log.event(event_id)
    if logged is None or not caller.may_see(logged.tenant):
        raise ApiError(404, "not_found", f"no event {event_id} in the delivery log")
    endpoint = state.registry.get(request.endpoint_id)
    if endpoint is None or endpoint.tenant != logged.tenant or not caller.sees_endpoint(endpoint.id):
        raise ApiError(404, "not_found", f"no endpoint {request.endpoint_id} of tenant {logged.tenant}")
    polling.refuse_if_polling(endpoint, "a resend")
    body = await read_at(state.broker, topology.EVENT_LOG, logged.offset, timeout_s=READ_TIMEOUT_S)
    if body is None:
        raise ApiError(
            410, "event_expired", "the event log no longer holds this event (its retention cut it)"
        )
    earlier = await state.delivery_log.attempts_of_event(event_id)
    try:
        _, record = await state.attempts.make(
            endpoint, event_id=event_id, event_type=logged.type, body=body, kind="manual",
            number=1 + sum(a.endpoint_id == endpoint.id for a in earlier), sequence=_sequence_of(body),
        )  # fmt: skip
    except SealedSecretError as exc:
        raise ApiError(503, "secret_unavailable", str(exc)) from None
    log.info(
        "event_resent",
        event_id=event_id,
        endpoint_id=endpoint.id,
        tenant=endpoint.tenant,
        status=record.status,
    )
    await state.trail.record(
        caller, "event.resent", tenant=endpoint.tenant, target=event_id,
        changes={"endpoint_id": endpoint.id, "status": record.status},
    )  # fmt: skip
    return EndpointAttempt(
        event_id=event_id, endpoint_id=endpoint.id, **attempt_view(state.sealer, record).model_dump()
    )


def _sequence_of(body: bytes) -> int | None:
    """The event's ``sequence``, sent again as ``webhook-sequence``."""
    try:
        return Event.model_validate_json(body).sequence
    except ValidationError:
        return None  # not an event (the log keeps what upstreams published): no sequence to send


async def _story(state: IngestState, logged: LoggedEvent, *, with_attempts: bool = True) -> EventStory:
    attempts = await state.delivery_log.attempts_of_event(logged.event_id)
    deferrals = await state.delivery_log.deferrals_of_event(logged.event_id)
    dead = await state.dead_letters_index.select(event_id=logged.event_id)
    subscribed = [
        endpoint.id
        for endpoint in state.registry.subscriptions.subscribed(logged.tenant, logged.type)
        if state.registry.get(endpoint.id) is not None
    ]
    # Endpoints that were attempted too: their patterns may have changed since, or they are gone.
    endpoint_ids = list(dict.fromkeys([*subscribed, *(a.endpoint_id for a in attempts)]))
    now_s = time.time()
    screen = _Screen(state, logged)
    courses = []
    for endpoint_id in endpoint_ids:
        mine = [a for a in attempts if a.endpoint_id == endpoint_id]
        endpoint = state.registry.get(endpoint_id)
        verdict = await screen.verdict(endpoint) if endpoint is not None and not mine else None
        where = (
            filtered_out(verdict)
            if verdict is not None and not verdict.matches
            else standing(
                endpoint,
                mine,
                [item for item in dead if item.endpoint_id == endpoint_id],
                state.breakers.state(endpoint_id),
                next((d for d in reversed(deferrals) if d.endpoint_id == endpoint_id), None),
                now_s=now_s,
            )
        )
        courses.append(
            EndpointCourse(
                endpoint_id=endpoint_id,
                attempts=[attempt_view(state.sealer, a) for a in mine] if with_attempts else [],
                **where.model_dump(),
            )
        )
    return EventStory(
        id=logged.event_id,
        tenant=logged.tenant,
        type=logged.type,
        subject=logged.subject,
        accepted_at=datetime.fromtimestamp(logged.accepted_at_s, UTC),
        endpoints=courses,
    )


class _Screen:
    """The verdict of an endpoint's current filter on a logged event, for one without attempts: the
    event is read back from the event log once, and only when one of its endpoints has a filter."""

    def __init__(self, state: IngestState, logged: LoggedEvent) -> None:
        self._state = state
        self._logged = logged
        self._context: cel.Context | None = None
        self._read = False

    async def verdict(self, endpoint: StoredEndpoint) -> filters.Verdict | None:
        if endpoint.filter is None:
            return None
        if not self._read:
            self._read = True
            body = await read_at(
                self._state.broker, topology.EVENT_LOG, self._logged.offset, timeout_s=READ_TIMEOUT_S
            )
            if body is not None:  # trimmed from the log: its state at the endpoint is told as before
                self._context = filters.context(orjson.loads(body))
        if self._context is None:
            return None
        return filters.verdict(endpoint.filter, self._context)


def attempt_view(sealer: Sealer, record: AttemptRecord) -> AttemptView:
    """An attempt as the API shows it, the start of the receiver's answer opened (sealed at rest)."""
    body = record.response_body
    if body is not None:
        try:
            body = sealer.open(body, purpose=RESPONSE_PURPOSE)
        except SealedSecretError:
            body = "(sealed with another HOOKLINE_SECRET_KEY)"
    return AttemptView(
        attempt=record.attempt,
        kind=record.attempt_kind,
        at=datetime.fromtimestamp(record.at_s, UTC),
        status=record.status,
        outcome=record.outcome,
        error=record.error,
        duration_ms=record.duration_ms,
        dns_ms=record.dns_ms,
        connect_ms=record.connect_ms,
        first_byte_ms=record.first_byte_ms,
        dispatcher_id=record.dispatcher_id,
        next_attempt_at=datetime.fromtimestamp(record.next_attempt_at_s, UTC)
        if record.next_attempt_at_s
        else None,
        dead_letter_reason=record.dead_letter_reason,
        response_headers=record.response_headers,
        response_body=body,
    )


def _cursor(after: str | None) -> int | None:
    return None if after is None else int(after[1:])  # its shape checked by the query's pattern
