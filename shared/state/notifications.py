"""Operational notifications to a tenant: its endpoint is failing, recovered, about to be disabled,
disabled, or leaving dead letters.

They go to the endpoint's ``notify_url``, delivered by hookline itself (signed, retried, in the delivery
log) through a *notifier*: an endpoint of the reserved operator tenant, one per (tenant, URL, format),
whose id is derived from those three so that every ingest replica and the monitor agree on it without
asking. The ingest registers notifiers (and resumes a disabled one when an endpoint names its URL again);
the leading monitor publishes notification events straight into the notifier's queue, never through
``events``, so a tenant whose only endpoint is broken still hears, and removes a notifier that no
endpoint names any more (:func:`unnamed_notifiers`).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import orjson

from hookline.shared.contracts.ids import encode_ulid, new_id
from hookline.shared.contracts.models import BodyFormat, Event, StoredEndpoint

#: The tenant notifiers belong to; no upstream or API caller may use it.
OPERATOR_TENANT = "hookline"
#: What a notifier's queue is bound to on ``events``: a type that the ingest never accepts (the tenant is
#: reserved), so a notifier receives notifications only.
NOTIFIER_EVENT_TYPE = "hookline.notification"


class Notice(enum.StrEnum):
    FAILING = "endpoint.failing"  # its breaker opened
    RECOVERED = "endpoint.recovered"  # its breaker closed again
    DISABLING = "endpoint.disabling"  # the warning: open for half the time after which it is disabled
    DISABLED = "endpoint.disabled"
    DEAD_LETTERS_GROWING = "dead_letters.growing"


#: Which alert transition tells a tenant what. An alert that resolves because its endpoint was disabled
#: or deleted is no recovery: :func:`notice_for` checks the endpoint is active.
_NOTICES: dict[tuple[str, str], Notice] = {
    ("breaker_open", "firing"): Notice.FAILING,
    ("breaker_open", "resolved"): Notice.RECOVERED,
    ("endpoint_disabling", "firing"): Notice.DISABLING,
    ("endpoint_disabled", "firing"): Notice.DISABLED,
    ("dead_letters_growing", "firing"): Notice.DEAD_LETTERS_GROWING,
}


def notice_for(alert: str, state: str, endpoint: StoredEndpoint | None) -> Notice | None:
    """The notification an alert's firing or resolution sends, if its endpoint asked for them."""
    notice = _NOTICES.get((alert, state))
    if notice is None or endpoint is None or endpoint.notify_url is None:
        return None
    if notice is Notice.RECOVERED and endpoint.status != "active":
        return None
    return notice


def notifier_id(tenant: str, url: str, body_format: BodyFormat) -> str:
    """The notifier's endpoint id: the same on every replica for the same tenant, URL and format."""
    digest = hashlib.sha256(f"{tenant}\0{url}\0{body_format}".encode()).digest()
    return f"ep_{encode_ulid(0, digest[:10])}"


def notifier_of(endpoint: StoredEndpoint) -> str | None:
    if endpoint.notify_url is None:
        return None
    return notifier_id(endpoint.tenant, endpoint.notify_url, endpoint.notify_format)


def unnamed_notifiers(
    notifiers: Iterable[StoredEndpoint], named: Callable[[str], bool]
) -> list[StoredEndpoint]:
    """The notifiers (the operator tenant's endpoints: the ingest refuses that tenant to every caller)
    that no endpoint names any more (``named``: whether one does): every endpoint that named one changed
    its notify_url or notify_format, dropped it, or was deleted."""
    return [notifier for notifier in notifiers if not named(notifier.id)]


def notification(notice: Notice, endpoint: StoredEndpoint, detail: str, *, now: datetime) -> Event:
    """The event a notifier delivers: about ``endpoint``, for its tenant, with a line a human reads."""
    text = f"hookline: endpoint {endpoint.id} ({endpoint.url}) of tenant {endpoint.tenant}: {notice.value}: {detail}"
    data: dict[str, Any] = {
        "tenant": endpoint.tenant,
        "endpoint_id": endpoint.id,
        "url": endpoint.url,
        "status": endpoint.status,
        "detail": detail,
        "text": text,
    }
    return Event(
        id=new_id("evt"),
        type=notice.value,
        tenant=OPERATOR_TENANT,
        occurred_at=now,
        subject=endpoint.id,
        data=data,
    )


def render(body_format: BodyFormat, body: bytes) -> bytes:
    """What is POSTed: the event itself, or for Slack-compatible incoming webhooks ``{"text": ...}``
    (the event's ``data.text`` when it has one, else its type and data). Signed as sent."""
    if body_format == "event":
        return body
    event = orjson.loads(body)
    data = event.get("data") or {}
    text = data.get("text") if isinstance(data.get("text"), str) else None
    return orjson.dumps({"text": text or f"{event.get('type')}: {orjson.dumps(data).decode()}"})
