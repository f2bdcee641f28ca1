"""``POST /v1/endpoints/{id}/replay``: resend an endpoint's events from the event log, same ids.

Every event published to ``events`` is also routed to the stream ``hookline.events.log`` (retention
``HOOKLINE_EVENT_LOG_MAX_AGE_S``). A replay reads the stream from ``since`` to the present and resends
the events of the endpoint's tenant whose type matches its patterns and that were accepted in
[since, until]. The accepted time is the API's ``x-hookline-accepted-at-ms`` header, else the AMQP
timestamp (whole seconds), else the event's ``occurred_at`` (an upstream that set neither).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import orjson
import structlog
from fastapi import APIRouter
from pydantic import AwareDatetime

from hookline.ingest import polling
from hookline.ingest.auth import Caller
from hookline.ingest.resend import Resend, resend
from hookline.ingest.state import State
from hookline.ingest.writes import invalid
from hookline.shared.broker import topology
from hookline.shared.broker.streams import Record, read_until_now
from hookline.shared.contracts.headers import Header
from hookline.shared.contracts.models import Model, StoredEndpoint
from hookline.shared.outbound import filters

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/v1/endpoints", tags=["endpoints"])

# The stream attaches a time-based start to a chunk with one-second accuracy: start a little earlier
# and filter exactly.
_SEEK_MARGIN = timedelta(seconds=2)
#: The earliest start a stream takes (an AMQP timestamp counts seconds from the Unix epoch): a replay
#: since an earlier time reads the log from its first event (the fuzzer's year 511 was a 500).
_EARLIEST_START = datetime(1970, 1, 1, tzinfo=UTC) + _SEEK_MARGIN
REPLAY_TIMEOUT_S = 300.0


class ReplayRequest(Model):
    since: AwareDatetime
    until: AwareDatetime | None = None


class ReplayResult(Model):
    replayed: int
    since: AwareDatetime
    until: AwareDatetime


def selects(
    endpoint: StoredEndpoint, event: object, accepted_at: datetime | None, since: datetime, until: datetime
) -> bool:
    """Whether a logged event belongs to this endpoint's replay window, and its filter as it is now
    admits it (pure)."""
    if not isinstance(event, dict) or event.get("tenant") != endpoint.tenant:
        return False
    event_type = event.get("type")
    if not isinstance(event_type, str) or not isinstance(event.get("id"), str):
        return False
    if accepted_at is None or not since <= accepted_at <= until:
        return False
    subscribed = any(topology.topic_matches(pattern, event_type) for pattern in endpoint.event_types)
    return subscribed and filters.admits(endpoint.filter, event)


def accepted_time(message: Record, event: object) -> datetime | None:
    accepted_ms = (message.headers or {}).get(Header.ACCEPTED_AT_MS)
    if isinstance(accepted_ms, int):
        return datetime.fromtimestamp(accepted_ms / 1000, UTC)
    if message.timestamp is not None:
        stamp = message.timestamp
        return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)
    occurred = event.get("occurred_at") if isinstance(event, dict) else None
    try:
        return datetime.fromisoformat(occurred) if isinstance(occurred, str) else None
    except ValueError:
        return None


@router.post("/{endpoint_id}/replay", response_model=ReplayResult)
async def replay(endpoint_id: str, request: ReplayRequest, state: State, caller: Caller) -> ReplayResult:
    endpoint = caller.endpoint(state.registry, endpoint_id)
    polling.refuse_if_polling(endpoint, "replay (poll from an earlier iterator instead)")
    until = request.until or datetime.now(UTC)
    if until < request.since:
        # Named for the field the caller gave: an omitted ``until`` is now, and a future ``since`` is wrong.
        if request.until is None:
            raise invalid("since", "is in the future: nothing has been accepted after it yet")
        raise invalid("until", "is before since")
    found: dict[str, bytes] = {}

    def collect(message: Record) -> None:
        try:
            event = orjson.loads(message.body)
        except orjson.JSONDecodeError:
            return  # invalid events are in the log too; they were dead-lettered, not delivered
        if not isinstance(event, dict) or not topology.published_as(message.routing_key, event):
            return  # claims a tenant its routing key does not: never delivered, never replayed
        if selects(endpoint, event, accepted_time(message, event), request.since, until):
            found.setdefault(event["id"], message.body)  # the same event published twice is replayed once

    await read_until_now(
        state.broker,
        state.publisher,
        topology.EVENT_LOG,
        collect,
        start=max(request.since, _EARLIEST_START) - _SEEK_MARGIN,
        timeout_s=REPLAY_TIMEOUT_S,
    )
    sent = await resend(
        state.registry,
        state.publisher,
        state.isolation,
        (Resend(endpoint.id, event_id, body, origin="replay") for event_id, body in found.items()),
    )
    log.info("endpoint_replayed", endpoint_id=endpoint.id, tenant=endpoint.tenant, count=sent)
    await state.trail.record(
        caller, "endpoint.replayed", tenant=endpoint.tenant, target=endpoint.id,
        changes={"since": request.since.isoformat(), "until": until.isoformat(), "replayed": sent},
    )  # fmt: skip
    return ReplayResult(replayed=sent, since=request.since, until=until)
