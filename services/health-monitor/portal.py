"""The customer portal at ``/portal/``: the pages with which an operator's customers, inside an iframe of
the operator's own site, manage their endpoints, send test events, and see and fix their deliveries.

The session is carried in the path (``/portal/s/<session>/…``), not in a cookie: a cookie set inside a
cross-site iframe is not sent back when it is ``SameSite=Strict`` or ``Lax``, and browsers block
third-party cookies more and more; a path survives both. It is also the pages' CSRF defence (another
site cannot know it), and it never leaves in a ``Referer`` (``no-referrer``; the pages link nowhere
else). Every page presents the session to the ingest API as its bearer token, so the ingest alone
decides what it may see and do (its tenant, its endpoints, read-only), as for the dashboard; this
monitor keeps nothing of it, so any monitor serves any session.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import quote, urlencode, urlsplit

import structlog
from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from hookline.health_monitor.dashboard import (
    TEMPLATES,
    Ingest,
    action_body,
    filter_trial,
    form_pairs,
    ingest_api,
    ms,
    tried,
)
from hookline.health_monitor.ingest_api import IngestApi, IngestApiError
from hookline.health_monitor.monitor import Monitor
from hookline.health_monitor.settings import MonitorSettings
from hookline.health_monitor.statusapi import endpoint_view
from hookline.shared.contracts.models import DeadLetterReason
from hookline.shared.runtime.api import ApiError

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/portal", include_in_schema=False)

#: What an endpoint's page posts to /portal/s/<session>/endpoints/<id>/<action>.
ACTIONS = (
    "edit",
    "pause",
    "resume",
    "verify",
    "test",
    "replay",
    "secret",
    "rotate-secret",
    "delete",
    "try-filter",
)
MAX_SHOWN_ENDPOINTS = 100  # each with its last attempt, asked of the ingest at once


@dataclass(frozen=True)
class Look:
    """The portal's branding and its pages' headers, from the settings, built once."""

    brand_name: str
    logo_url: str | None
    accent: str
    headers: dict[str, str]

    @classmethod
    def of(cls, settings: MonitorSettings) -> Look:
        ancestors = settings.portal_frame_ancestors.strip() or "'none'"
        logo = settings.portal_logo_url
        logo_origin = f" {urlsplit(logo).scheme}://{urlsplit(logo).netloc}" if logo else ""
        return cls(
            brand_name=settings.portal_brand_name,
            logo_url=logo,
            accent=settings.portal_accent,
            headers={
                # No script at all; framed only by the operator's own origins.
                "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; "
                f"img-src 'self' data:{logo_origin}; form-action 'self'; frame-ancestors {ancestors}; "
                "base-uri 'none'",
                "cache-control": "no-store",
                "x-content-type-options": "nosniff",
                "referrer-policy": "no-referrer",
            },
        )


@dataclass(frozen=True)
class Visit:
    """One request of a portal session, as the ingest describes the session."""

    session: str
    tenant: str
    read_only: bool
    limited: bool  # to some endpoints: it cannot add one

    @property
    def base(self) -> str:
        return f"/portal/s/{self.session}"


class PortalPageError(Exception):
    """A page saying what went wrong (a session ended, a link used, the ingest not answering) in place
    of the page asked for: a customer reads it, not an API client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _look(request: Request) -> Look:
    look: Look = request.app.state.portal_look
    return look


async def _visit(request: Request, session: str) -> Visit:
    try:
        identity = await ingest_api(request).call(session, "GET", "/v1/whoami")
    except IngestApiError as exc:
        if exc.status in (401, 403):
            raise PortalPageError(401, "This session has ended. Open the page again for a new one.") from None
        raise PortalPageError(503, f"The service is not answering: {exc.message}") from None
    grant = identity.get("portal")
    if grant is None:  # an API token pasted into the path: not a portal session
        raise PortalPageError(401, "This is not a portal session.")
    return Visit(
        session=session,
        tenant=identity["tenant"],
        read_only=grant["read_only"],
        limited=grant["endpoint_ids"] is not None,
    )


Current = Annotated[Visit, Depends(_visit)]


async def _read(ingest: IngestApi, visit: Visit, path: str, **params: str) -> Any:
    """What a page shows, asked of the ingest with the session (PortalPageError: why it cannot)."""
    try:
        return await ingest.call(visit.session, "GET", path, params=params)
    except IngestApiError as exc:
        raise PortalPageError(exc.status, exc.message) from None


def problem_page(request: Request, exc: Exception) -> HTMLResponse:
    assert isinstance(exc, PortalPageError)
    return _page(request, "portal/problem.html", None, status_code=exc.status, problem=exc.message)


def _page(
    request: Request, name: str, visit: Visit | None, *, status_code: int = 200, **context: Any
) -> HTMLResponse:
    context = {
        "notice": request.query_params.get("notice"),
        "problem": request.query_params.get("problem"),
        **context,
    }
    look = _look(request)
    html = TEMPLATES.get_template(name).render(visit=visit, look=look, **context)
    return HTMLResponse(html, status_code=status_code, headers=look.headers)


def _to(visit: Visit, path: str, **message: str) -> RedirectResponse:
    return RedirectResponse(f"{visit.base}{path}?{urlencode(message)}", status_code=303)


# --- opening a link ---------------------------------------------------------------------------------


@router.get("/open/{link}")
async def open_link(request: Request, link: str, ingest: Ingest) -> Response:
    try:
        opened = await ingest.call(None, "POST", "/v1/portal/open", json={"link": link})
    except IngestApiError as exc:
        message = {
            410: "This link was opened already. Open the page again for a new one.",
            401: "This link is not valid, or it has expired. Open the page again for a new one.",
        }.get(exc.status, f"The service is not answering: {exc.message}")
        raise PortalPageError(exc.status if exc.status in (401, 410) else 503, message) from None
    log.info("portal_opened", tenant=opened["tenant"])
    return RedirectResponse(f"/portal/s/{opened['session']}/", status_code=303)


# --- endpoints --------------------------------------------------------------------------------------


def _monitor(request: Request) -> Monitor:
    monitor: Monitor = request.app.state.monitor
    return monitor


async def _last_attempt(ingest: IngestApi, visit: Visit, endpoint_id: str) -> dict[str, Any] | None:
    try:
        page = await ingest.call(
            visit.session, "GET", f"/v1/endpoints/{endpoint_id}/attempts", params={"limit": "1"}
        )
    except IngestApiError:
        return None
    return page["data"][0] if page["data"] else None


async def _catalog(ingest: IngestApi, visit: Visit) -> list[dict[str, Any]]:
    try:
        listed = await ingest.call(visit.session, "GET", "/v1/event-types")
    except IngestApiError:
        return []
    return [t for t in listed["data"] if not t["deprecated"]]


@router.get("/s/{session}/")
async def endpoints(request: Request, visit: Current, ingest: Ingest) -> HTMLResponse:
    listed = await _read(ingest, visit, "/v1/endpoints", limit="1000")
    shown = listed["data"][:MAX_SHOWN_ENDPOINTS]
    monitor, now_s = _monitor(request), time.time()
    health = [endpoint_view(monitor, e["id"], monitor.registry.get(e["id"]), now_s) for e in shown]
    last = await asyncio.gather(*(_last_attempt(ingest, visit, e["id"]) for e in shown))
    adding = not visit.read_only and not visit.limited
    return _page(
        request,
        "portal/endpoints.html",
        visit,
        rows=list(zip(shown, health, last, strict=True)),
        total=len(listed["data"]),
        catalog=await _catalog(ingest, visit) if adding else [],
        adding=adding,
    )


def _endpoint_fields(fields: list[tuple[str, str]]) -> dict[str, Any]:
    """An endpoint's form, as the API's fields (ValueError: what is wrong with it)."""
    form = dict(fields)
    spec: dict[str, Any] = {
        "url": form.get("url", "").strip(),
        "description": form.get("description", "").strip(),
        "event_types": [value for key, value in fields if key == "event_types"] or None,
        "notify_url": form.get("notify_url", "").strip() or None,
        "filter": form.get("filter", "").strip() or None,
    }
    rate = form.get("rate_limit_per_s", "").strip()
    try:
        spec["rate_limit_per_s"] = float(rate) if rate else None
    except ValueError:
        raise ValueError("the rate limit must be a number of deliveries per second") from None
    headers: dict[str, str] = {}
    for line in form.get("headers", "").splitlines():
        if line.strip():
            name, colon, value = line.partition(":")
            if not colon:
                raise ValueError(f"a header is 'Name: value', one per line (not {line.strip()!r})")
            headers[name.strip()] = value.strip()
    if headers:
        spec["headers"] = headers
    return spec


@router.post("/s/{session}/endpoints")
async def add_endpoint(request: Request, visit: Current, ingest: Ingest) -> Response:
    try:
        spec = _endpoint_fields(await form_pairs(request))
    except ValueError as exc:
        return _to(visit, "/", problem=str(exc))
    if spec["event_types"] is None:
        return _to(visit, "/", problem="choose at least one event type")
    try:
        created = await ingest.call(
            visit.session, "POST", "/v1/endpoints", json={"tenant": visit.tenant, **spec}
        )
    except IngestApiError as exc:
        return _to(visit, "/", problem=f"The endpoint was not added: {exc.message}")
    log.info("portal_endpoint_added", tenant=visit.tenant, endpoint_id=created["id"])
    return _page(request, "portal/secret.html", visit, endpoint=created, secret=created["secret"], added=True)


@router.get("/s/{session}/endpoints/{endpoint_id}")
async def endpoint(request: Request, endpoint_id: str, visit: Current, ingest: Ingest) -> HTMLResponse:
    path = f"/v1/endpoints/{quote(endpoint_id, safe='')}"
    found, attempts = await asyncio.gather(
        _read(ingest, visit, path), _read(ingest, visit, f"{path}/attempts", limit="20")
    )
    monitor = _monitor(request)
    return _page(
        request,
        "portal/endpoint.html",
        visit,
        endpoint=found,
        health=endpoint_view(monitor, endpoint_id, monitor.registry.get(endpoint_id), time.time()),
        attempts=attempts["data"],
        catalog=await _catalog(ingest, visit),
    )


@router.post("/s/{session}/endpoints/{endpoint_id}/{action}")
async def endpoint_action(
    request: Request, endpoint_id: str, action: str, visit: Current, ingest: Ingest
) -> Response:
    if action not in ACTIONS:
        raise ApiError(404, "not_found", f"no endpoint action {action!r}")
    fields = await form_pairs(request)
    here = f"/endpoints/{quote(endpoint_id, safe='')}"
    path = f"/v1{here}"
    try:
        match action:
            case "edit":
                await ingest.call(visit.session, "PATCH", path, json=_endpoint_fields(fields))
                notice = "Saved."
            case "secret" | "rotate-secret":
                shown = await ingest.call(
                    visit.session, "GET" if action == "secret" else "POST", f"{path}/{action}"
                )
                found = await ingest.call(visit.session, "GET", path)
                return _page(request, "portal/secret.html", visit, endpoint=found, added=False, **shown)
            case "delete":
                await ingest.call(visit.session, "DELETE", path)
                return _to(visit, "/", notice=f"Deleted {endpoint_id}.")
            case "try-filter":
                trial = filter_trial(dict(fields))
                notice = tried(await ingest.call(visit.session, "POST", f"{path}/filter/test", json=trial))
            case _:
                result = await ingest.call(
                    visit.session, "POST", f"{path}/{action}", json=action_body(action, dict(fields))
                )
                notice = _done(action, result)
    except ValueError as exc:
        return _to(visit, here, problem=str(exc))
    except IngestApiError as exc:
        return _to(visit, here, problem=f"{action.replace('-', ' ').capitalize()} refused: {exc.message}")
    log.info("portal_endpoint_action", tenant=visit.tenant, endpoint_id=endpoint_id, action=action)
    return _to(visit, here, notice=notice)


def _done(action: str, result: dict[str, Any]) -> str:
    match action:
        case "pause":
            return "Paused: events wait until it is resumed."
        case "resume":
            return "Resumed."
        case "verify":
            return "Verified." if result["verified"] else "It did not pass verification."
        case "test":
            answer = f"HTTP {result['status']}" if result["status"] is not None else result["error"]
            return f"Test event {result['event_id']}: {answer} in {ms(result['duration_ms'])}."
        case _:
            return f"Replaying {result['replayed']} events."


# --- deliveries -------------------------------------------------------------------------------------


@router.get("/s/{session}/events")
async def events(request: Request, visit: Current, ingest: Ingest) -> HTMLResponse:
    params = {k: request.query_params.get(k, "") for k in ("state", "type", "after")}
    page = await _read(ingest, visit, "/v1/events", **params, limit="50")
    return _page(
        request,
        "portal/events.html",
        visit,
        events=page["data"],
        next_after=page["next_after"],
        filters=params,
    )


@router.get("/s/{session}/events/{event_id}")
async def event(request: Request, event_id: str, visit: Current, ingest: Ingest) -> HTMLResponse:
    story = await _read(ingest, visit, f"/v1/events/{quote(event_id, safe='')}")
    return _page(request, "portal/event.html", visit, story=story)


@router.post("/s/{session}/events/{event_id}/resend")
async def resend(request: Request, event_id: str, visit: Current, ingest: Ingest) -> Response:
    endpoint_id = dict(await form_pairs(request)).get("endpoint_id", "")
    here = f"/events/{quote(event_id, safe='')}"
    try:
        await ingest.call(visit.session, "POST", f"/v1{here}/resend", json={"endpoint_id": endpoint_id})
    except IngestApiError as exc:
        return _to(visit, here, problem=f"Resend refused: {exc.message}")
    return _to(visit, here, notice=f"Sent again to {endpoint_id}.")


@router.get("/s/{session}/dead-letters")
async def dead_letters(request: Request, visit: Current, ingest: Ingest) -> HTMLResponse:
    filters = {k: request.query_params.get(k, "") for k in ("endpoint_id", "reason", "after")}
    page = await _read(ingest, visit, "/v1/dead-letters", **filters, limit="100")
    return _page(
        request,
        "portal/dead_letters.html",
        visit,
        dead_letters=page["data"],
        next_after=page["next_after"],
        filters=filters,
        reasons=[reason.value for reason in DeadLetterReason],
    )


@router.post("/s/{session}/dead-letters/redrive")
async def redrive(request: Request, visit: Current, ingest: Ingest) -> Response:
    form = dict(await form_pairs(request))
    choice: dict[str, Any] = {k: form[k] for k in ("endpoint_id", "reason") if form.get(k)}
    if form.get("id"):
        choice["ids"] = [form["id"]]
    if not choice:
        return _to(visit, "/dead-letters", problem="choose what to redrive (an endpoint or one dead letter)")
    try:
        result = await ingest.call(visit.session, "POST", "/v1/dead-letters/redrive", json=choice)
    except IngestApiError as exc:
        return _to(visit, "/dead-letters", problem=f"Redrive refused: {exc.message}")
    return _to(visit, "/dead-letters", notice=f"Redrove {result['redriven']} (skipped {result['skipped']}).")
