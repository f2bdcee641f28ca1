"""The support dashboard at ``/ui/``: server-rendered pages, no script, every action a plain form.

Health, alerts and the dead-letter analysis come from this monitor's own state. Events, their stories,
dead letters and every action (resend, redrive, pause, resume, verify, replay) go to the ingest API with
the logged-in user's own token, so what a tenant token may see and do is decided by the ingest alone;
the pages drawn from local state keep to the session's tenant the same way.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Annotated, Any, get_args
from urllib.parse import parse_qsl, quote, urlencode

import jinja2
import structlog
from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from hookline.health_monitor import sparkline
from hookline.health_monitor.ingest_api import IngestApi, IngestApiError
from hookline.health_monitor.monitor import Monitor
from hookline.health_monitor.sessions import COOKIE, Session, Sessions
from hookline.health_monitor.statusapi import endpoint_view, status
from hookline.shared.contracts.control import BreakerState
from hookline.shared.contracts.models import DeadLetterReason, EventState
from hookline.shared.contracts.status import EndpointHealthView
from hookline.shared.runtime.api import ApiError

log = structlog.get_logger(__name__)
router = APIRouter(prefix="/ui", include_in_schema=False)

MAX_FORM_BYTES = 64 * 1024
MAX_ROWS = 200  # endpoints on the overview, degrading first; the rest are counted
ENDPOINT_ACTIONS = ("pause", "resume", "verify", "replay", "test", "filter", "try-filter")
EVENT_STATES = get_args(EventState)
# No script at all, and nothing framed or cached: the pages hold tenants' data.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "cache-control": "no-store",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}

TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("hookline.health_monitor", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
)


def _clock(value: str | datetime | None) -> str:
    if value is None:
        return "—"
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f} ms" if value >= 10 else f"{value:.1f} ms"


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


TEMPLATES.filters.update(clock=_clock, ms=ms, rate=_rate)


# --- sessions ---------------------------------------------------------------------------------------


def _sessions(request: Request) -> Sessions:
    sessions: Sessions = request.app.state.sessions
    return sessions


def ingest_api(request: Request) -> IngestApi:
    """The ingest API client of the app (the dashboard's and the portal's)."""
    ingest: IngestApi = request.app.state.ingest_api
    return ingest


def logged_in(request: Request) -> Session:
    session = _sessions(request).get(request.cookies.get(COOKIE), now_s=time.time())
    if session is None:
        raise ApiError(303, "login_required", "log in first", headers={"location": "/ui/login"})
    return session


Current = Annotated[Session, Depends(logged_in)]
Ingest = Annotated[IngestApi, Depends(ingest_api)]


def _monitor(request: Request) -> Monitor:
    monitor: Monitor = request.app.state.monitor
    return monitor


LocalState = Annotated[Monitor, Depends(_monitor)]


async def form_pairs(request: Request) -> list[tuple[str, str]]:
    """The posted form as its pairs, in order (a field chosen several times comes several times)."""
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise ApiError(413, "payload_too_large", f"a form of at most {MAX_FORM_BYTES} bytes")
    return parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)


async def read_form(request: Request, session: Session | None) -> dict[str, str]:
    """The posted form; with a session, only when it carries that session's CSRF token."""
    fields = dict(await form_pairs(request))
    if session is not None and not session.accepts(fields.get("csrf", "")):
        raise ApiError(403, "forbidden", "the form is stale or came from another site; reload the page")
    return fields


def _page(name: str, session: Session | None, *, status_code: int = 200, **context: Any) -> HTMLResponse:
    context = {"notice": None, "problem": None, **context}
    html = TEMPLATES.get_template(name).render(session=session, **context)
    return HTMLResponse(html, status_code=status_code, headers=SECURITY_HEADERS)


def _back(fields: dict[str, str], fallback: str, **message: str) -> RedirectResponse:
    """Back to the page the form was on (a /ui/ path only), with a notice or a problem to show."""
    target = fields.get("back", "")
    if not target.startswith("/ui/") or target.startswith("//"):
        target = fallback
    path, _, query = target.partition("?")
    kept = [(k, v) for k, v in parse_qsl(query) if k not in ("notice", "problem")]
    return RedirectResponse(f"{path}?{urlencode(kept + list(message.items()))}", status_code=303)


def _page_for(
    request: Request, name: str, session: Session, *, problem: str | None = None, **context: Any
) -> HTMLResponse:
    """A page that also shows the notice or problem an action redirected here with."""
    return _page(
        name,
        session,
        notice=request.query_params.get("notice"),
        problem=problem or request.query_params.get("problem"),
        **context,
    )


@router.get("/login")
async def login_form(request: Request) -> HTMLResponse:
    return _page("login.html", None, problem=request.query_params.get("problem"))


@router.post("/login")
async def login(request: Request, ingest: Ingest) -> Response:
    token = (await read_form(request, None)).get("token", "").strip()
    try:
        identity = await ingest.call(token, "GET", "/v1/whoami") if token else None
    except IngestApiError as exc:
        if exc.status != 401:
            return _page(
                "login.html", None, status_code=503, problem=f"cannot check the token: {exc.message}"
            )
        identity = None
    if identity is None:
        log.info("dashboard_login_refused")
        return _page("login.html", None, status_code=401, problem="That token is not valid here.")
    session = _sessions(request).open(token=token, tenant=identity["tenant"], now_s=time.time())
    log.info("dashboard_login", tenant=session.tenant, admin=session.tenant is None)
    response = RedirectResponse("/ui/", status_code=303)
    response.set_cookie(
        COOKIE,
        session.id,
        max_age=int(_sessions(request).ttl_s),
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
async def logout(request: Request, session: Current) -> Response:
    await read_form(request, session)
    _sessions(request).close(session.id)
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui")
    return response


# --- the overview -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class EndpointRow:
    health: EndpointHealthView
    url: str | None  # None: a polling endpoint (nothing is pushed to it, so no push actions either)
    sparkline: str  # SVG polyline points: p95 per 5 minutes over the last hour
    filter: str | None = None  # its CEL filter

    @property
    def degrading(self) -> bool:
        return self.health.slow or self.health.breaker_state is not BreakerState.CLOSED


def ranked(rows: list[EndpointRow]) -> list[EndpointRow]:
    """Degrading endpoints first (open breakers, then half-open, then slow), then by recent p95."""
    order = {BreakerState.OPEN: 0, BreakerState.HALF_OPEN: 1, BreakerState.CLOSED: 2}

    def key(row: EndpointRow) -> tuple[int, bool, float]:
        recent = row.health.last_5m.p95_ms or row.health.p95_ms or 0.0
        return (order[row.health.breaker_state], not row.health.slow, -recent)

    return sorted(rows, key=key)


async def _summary(monitor: Monitor, session: Session, rows: list[EndpointRow]) -> list[tuple[str, str]]:
    """The one-row status: the whole system for the admin, the tenant's own endpoints for a tenant."""
    if session.tenant is None:
        s = await status(monitor)
        return [
            ("pending", f"{s.pending:,}"),
            ("awaiting retry", f"{s.awaiting_retry:,}"),
            ("in flight", f"{s.in_flight:,}"),
            ("dead letters", f"{s.dead_letter:,}"),
            ("delivered 1 h", f"{s.delivered_last_hour:,}"),
            ("failed 1 h", f"{s.failed_last_hour:,}"),
            ("mean", ms(s.mean_delivery_ms)),
            ("endpoints", f"{s.endpoints:,}"),
            ("breakers open", f"{s.breakers_open:,}"),
            ("dispatchers", f"{s.dispatchers:,}"),
            ("broker", "BLOCKED" if s.broker.blocked else "ok"),
        ]
    now_s = time.time()
    hours = [
        monitor.health.endpoints[r.health.endpoint_id].hour
        for r in rows
        if r.health.endpoint_id in monitor.health.endpoints
    ]
    delivered = failed = 0
    for hour in hours:
        total = hour.total(now_s=now_s)
        delivered += total.successes
        failed += total.failures + total.permanent
    dead = sum(a.count for a in await monitor.dead_letters.analysis(tenant=session.tenant))
    return [
        ("pending", f"{sum(r.health.queue_depth or 0 for r in rows):,}"),
        ("dead letters", f"{dead:,}"),
        ("delivered 1 h", f"{delivered:,}"),
        ("failed 1 h", f"{failed:,}"),
        ("endpoints", f"{len(rows):,}"),
        ("breakers open", f"{sum(r.health.breaker_state is not BreakerState.CLOSED for r in rows):,}"),
    ]


@router.get("/")
async def overview(request: Request, session: Current, monitor: LocalState) -> HTMLResponse:
    now_s = time.time()
    tenant = session.tenant or request.query_params.get("tenant") or None
    views = [
        (endpoint, endpoint_view(monitor, endpoint.id, endpoint, now_s))
        for endpoint in monitor.endpoints_listed(tenant)
        if session.may_see(endpoint.tenant)
    ]
    rows = ranked(
        [
            EndpointRow(health=view, url=endpoint.url, sparkline="", filter=endpoint.filter)
            for endpoint, view in views
        ]
    )
    shown = [
        replace(row, sparkline=_sparkline(monitor, row.health.endpoint_id, now_s)) for row in rows[:MAX_ROWS]
    ]
    alerts = [
        alert
        for alert in monitor.alerting.alerts.firing.values()
        if session.may_see(alert.tenant) and (tenant is None or alert.tenant == tenant)
    ]
    return _page_for(
        request,
        "overview.html",
        session,
        summary=await _summary(monitor, session, rows),
        alerts=alerts,
        rows=shown,
        total=len(rows),
        tenant=tenant or "",
        back=f"/ui/?{urlencode({'tenant': tenant})}" if tenant else "/ui/",
    )


def _sparkline(monitor: Monitor, endpoint_id: str, now_s: float) -> str:
    health = monitor.health.endpoints.get(endpoint_id)
    if health is None:
        return ""
    return sparkline.points([s.percentile_ms(0.95) if s else None for s in health.hour.series(now_s=now_s)])


# --- events -----------------------------------------------------------------------------------------


@router.get("/events")
async def events(request: Request, session: Current, ingest: Ingest) -> Response:
    params = {k: request.query_params.get(k, "") for k in ("id", "state", "type", "subject", "after")}
    if event_id := params.pop("id").strip():
        return RedirectResponse(f"/ui/events/{quote(event_id, safe='')}", status_code=303)
    problem = None
    page: dict[str, Any] = {"data": [], "next_after": None}
    try:
        page = await ingest.call(session.token, "GET", "/v1/events", params={**params, "limit": "50"})
    except IngestApiError as exc:
        problem = exc.message
    return _page_for(
        request,
        "events.html",
        session,
        events=page["data"],
        next_after=page["next_after"],
        filters=params,
        states=EVENT_STATES,
        problem=problem,
    )


@router.get("/events/{event_id}")
async def event(request: Request, event_id: str, session: Current, ingest: Ingest) -> HTMLResponse:
    try:
        story = await ingest.call(session.token, "GET", f"/v1/events/{quote(event_id, safe='')}")
    except IngestApiError as exc:
        return _page(
            "event.html",
            session,
            status_code=exc.status,
            story=None,
            event_id=event_id,
            problem=exc.message,
            notice=None,
        )
    return _page_for(
        request,
        "event.html",
        session,
        story=story,
        event_id=event_id,
        back=f"/ui/events/{event_id}",
    )


@router.post("/events/{event_id}/resend")
async def resend(request: Request, event_id: str, session: Current, ingest: Ingest) -> Response:
    fields = await read_form(request, session)
    endpoint_id = fields.get("endpoint_id", "")
    try:
        await ingest.call(
            session.token,
            "POST",
            f"/v1/events/{quote(event_id, safe='')}/resend",
            json={"endpoint_id": endpoint_id},
        )
    except IngestApiError as exc:
        return _back(fields, f"/ui/events/{event_id}", problem=f"resend refused: {exc.message}")
    log.info("dashboard_resend", tenant=session.tenant, event_id=event_id, endpoint_id=endpoint_id)
    return _back(fields, f"/ui/events/{event_id}", notice=f"Sent {event_id} to {endpoint_id} again.")


# --- audit trail ------------------------------------------------------------------------------------


@router.get("/audit")
async def audit(request: Request, session: Current, ingest: Ingest) -> HTMLResponse:
    """Who changed what, newest first (the ingest's audit trail; a tenant sees its own)."""
    after = request.query_params.get("after", "")
    problem = None
    page: dict[str, Any] = {"data": [], "next_after": None}
    params = {"order": "desc", "limit": "100", **({"after": after} if after else {})}
    try:
        page = await ingest.call(session.token, "GET", "/v1/audit", params=params)
    except IngestApiError as exc:
        problem = exc.message
    return _page_for(
        request, "audit.html", session, records=page["data"], next_after=page["next_after"], problem=problem
    )


# --- dead letters -----------------------------------------------------------------------------------


@router.get("/dead-letters")
async def dead_letters(
    request: Request, session: Current, monitor: LocalState, ingest: Ingest
) -> HTMLResponse:
    filters = {k: request.query_params.get(k, "") for k in ("endpoint_id", "reason", "event_id", "after")}
    problem = None
    page: dict[str, Any] = {"data": [], "next_after": None}
    try:
        page = await ingest.call(session.token, "GET", "/v1/dead-letters", params={**filters, "limit": "100"})
    except IngestApiError as exc:
        problem = exc.message
    analysis = await monitor.dead_letters.analysis(tenant=session.tenant)
    return _page_for(
        request,
        "dead_letters.html",
        session,
        dead_letters=page["data"],
        next_after=page["next_after"],
        analysis=analysis,
        filters=filters,
        reasons=[reason.value for reason in DeadLetterReason],
        back=str(request.url.path) + (f"?{request.url.query}" if request.url.query else ""),
        problem=problem,
    )


@router.post("/dead-letters/redrive")
async def redrive(request: Request, session: Current, ingest: Ingest) -> Response:
    fields = await read_form(request, session)
    choice: dict[str, Any] = {k: fields[k] for k in ("endpoint_id", "reason", "event_id") if fields.get(k)}
    if fields.get("id"):
        choice["ids"] = [fields["id"]]
    if not choice:
        return _back(
            fields, "/ui/dead-letters", problem="choose what to redrive (a filter or one dead letter)"
        )
    if session.tenant is not None:
        choice["tenant"] = session.tenant
    try:
        result = await ingest.call(session.token, "POST", "/v1/dead-letters/redrive", json=choice)
    except IngestApiError as exc:
        return _back(fields, "/ui/dead-letters", problem=f"redrive refused: {exc.message}")
    log.info("dashboard_redrive", tenant=session.tenant, redriven=result["redriven"])
    return _back(
        fields, "/ui/dead-letters", notice=f"Redrove {result['redriven']} (skipped {result['skipped']})."
    )


# --- endpoint actions -------------------------------------------------------------------------------


@router.post("/endpoints/{endpoint_id}/{action}")
async def endpoint_action(
    request: Request, endpoint_id: str, action: str, session: Current, ingest: Ingest
) -> Response:
    fields = await read_form(request, session)
    if action not in ENDPOINT_ACTIONS:
        raise ApiError(404, "not_found", f"no endpoint action {action!r}")
    try:
        body = action_body(action, fields)
    except ValueError as exc:
        return _back(fields, "/ui/", problem=str(exc))
    method, suffix = {"filter": ("PATCH", ""), "try-filter": ("POST", "/filter/test")}.get(
        action, ("POST", f"/{action}")
    )
    try:
        result = await ingest.call(
            session.token, method, f"/v1/endpoints/{quote(endpoint_id, safe='')}{suffix}", json=body
        )
    except IngestApiError as exc:
        return _back(fields, "/ui/", problem=f"{action} refused: {exc.message}")
    log.info("dashboard_endpoint_action", tenant=session.tenant, endpoint_id=endpoint_id, action=action)
    return _back(fields, "/ui/", notice=_done(action, endpoint_id, result))


def _done(action: str, endpoint_id: str, result: dict[str, Any]) -> str:
    match action:
        case "pause" | "resume":
            return f"{action.capitalize()}d {endpoint_id}."
        case "verify":
            return f"{endpoint_id} {'is verified' if result['verified'] else 'did not pass verification'}."
        case "test":
            answer = f"HTTP {result['status']}" if result["status"] is not None else result["error"]
            return (
                f"Test event {result['event_id']} to {endpoint_id}: {answer} in {ms(result['duration_ms'])}."
            )
        case "filter":
            return (
                f"{endpoint_id}'s filter is now {result['filter']!r}."
                if result["filter"]
                else (f"{endpoint_id} has no filter now: every event of its types.")
            )
        case "try-filter":
            return tried(result)
        case _:
            return f"Replaying {result['replayed']} events to {endpoint_id}."


def tried(verdict: dict[str, Any]) -> str:
    """What trying a filter on an event answered, in words."""
    if verdict["matches"]:
        return "The filter matches that event: it would be sent."
    why = f" ({verdict['error']})" if verdict["error"] else ""
    return f"The filter does not match that event{why}: it would not be sent."


def filter_trial(fields: dict[str, str]) -> dict[str, Any]:
    """``POST /v1/endpoints/{id}/filter/test``'s body from a form (ValueError: no event named)."""
    trial: dict[str, Any] = {"event_id": fields.get("event_id", "").strip()}
    if fields.get("filter", "").strip():
        trial["filter"] = fields["filter"].strip()
    if not trial["event_id"]:
        raise ValueError("name a recent event (its id) to try the filter on")
    return trial


def action_body(action: str, fields: dict[str, str]) -> dict[str, Any] | None:
    """The ingest request's body for an endpoint action's form (ValueError: what the form lacks)."""
    if action == "filter":
        return {"filter": fields.get("filter", "").strip() or None}
    if action == "try-filter":
        return filter_trial(fields)
    if action == "replay":
        try:
            since = datetime.fromisoformat(fields.get("since", ""))
        except ValueError:
            raise ValueError("replay needs a start time (since)") from None
        return {"since": (since if since.tzinfo else since.replace(tzinfo=UTC)).isoformat()}
    if action == "test":
        test: dict[str, Any] = {"type": fields.get("type", "").strip()}
        if fields.get("data", "").strip():
            try:
                test["data"] = json.loads(fields["data"])
            except json.JSONDecodeError:
                raise ValueError(
                    "a test event's data must be JSON (or empty: the catalog's example)"
                ) from None
        return test
    return None
