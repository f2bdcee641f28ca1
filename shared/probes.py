"""The probe routes every service serves: ``/healthz`` and ``/readyz`` for the orchestrator, ``/metrics``
for Prometheus.

What they answer is decided once, here, as plain values (:class:`ProbeAnswer`, :class:`Exposition`);
two adapters serve them: :func:`probe_server`, the small aiohttp server of a service without an API (a
dispatcher, an outbox relay), and :func:`probes_router`, the routes on the listener of a service with
a FastAPI API (the ingest, the monitor).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import prometheus_client
import structlog
from aiohttp import web
from pydantic import SecretStr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hookline.shared.bearer import UNAUTHORIZED_MESSAGE, presents_token
from hookline.shared.models import ErrorBody, ErrorDetail

if TYPE_CHECKING:
    from fastapi import APIRouter

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ProbeAnswer:
    """A probe's JSON answer, whichever framework sends it."""

    status: int
    body: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)


class Exposition(NamedTuple):
    """``/metrics``: the process's series in Prometheus's text format."""

    body: bytes
    content_type: str


def liveness() -> ProbeAnswer:
    """``/healthz``: the process answers, and nothing more is checked: an orchestrator restarts a
    process that fails it, and a restart mends no lost broker (``/readyz`` says what is missing)."""
    return ProbeAnswer(200, {"status": "ok"})


def readiness(problems: Sequence[str]) -> ProbeAnswer:
    """``/readyz``: ready when nothing is missing; otherwise 503 in the APIs' error shape, one detail a
    problem, so that a client shows it like any other error."""
    if not problems:
        return ProbeAnswer(200, {"status": "ready"})
    body = ErrorBody(
        error="not_ready",
        message="not ready: " + "; ".join(problems),
        details=[ErrorDetail(field=None, message=problem) for problem in problems],
    )
    return ProbeAnswer(503, body.model_dump(mode="json"))


def unauthorized() -> ProbeAnswer:
    """``/metrics`` without an accepted bearer token: the APIs' 401, the same whatever was wrong."""
    body = ErrorBody(error="unauthorized", message=UNAUTHORIZED_MESSAGE)
    return ProbeAnswer(401, body.model_dump(mode="json"), {"WWW-Authenticate": "Bearer"})


def exposition() -> Exposition:
    return Exposition(prometheus_client.generate_latest(), prometheus_client.CONTENT_TYPE_LATEST)


@asynccontextmanager
async def probe_server(
    host: str, port: int, *, problems: Callable[[], list[str]], metrics_token: SecretStr | None = None
) -> AsyncIterator[int]:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz``; yields the bound port (``port=0`` picks one).
    With ``metrics_token``, ``/metrics`` answers only that bearer token (the probes stay open for the
    orchestrator); without, it is open: its series name no endpoint or tenant."""
    accepted = (metrics_token.get_secret_value(),) if metrics_token else ()

    def respond(answer: ProbeAnswer) -> web.Response:
        return web.json_response(answer.body, status=answer.status, headers=dict(answer.headers))

    async def metrics(request: web.Request) -> web.Response:
        if accepted and not presents_token(request.headers.get("authorization", ""), accepted):
            return respond(unauthorized())
        body, content_type = exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def healthz(_: web.Request) -> web.Response:
        return respond(liveness())

    async def readyz(_: web.Request) -> web.Response:
        return respond(readiness(problems()))

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/healthz", healthz), web.get("/readyz", readyz)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.create_server((host, port), reuse_port=False)
    site = web.SockSite(runner, sock)
    await site.start()
    bound_port: int = sock.getsockname()[1]
    log.info("probe_server_listening", host=host, port=bound_port)
    try:
        yield bound_port
    finally:
        await runner.cleanup()


def probes_router(problems: Callable[[], list[str]], *, metrics_tokens: Sequence[str]) -> APIRouter:
    """The same routes on an API's own listener. ``problems`` says what is missing (the broker, a loop
    that is not running); ``/metrics`` answers only a bearer token of ``metrics_tokens``: it shares the
    API's listener, and the monitor's series name endpoints. The probes stay open: orchestrators call
    them without credentials."""
    # Imported here: the dispatcher and the outbox relay import this module and never need FastAPI. (The
    # routes' annotations name Starlette's Request and Response, imported at the top, which FastAPI
    # resolves from this module's globals.)
    from fastapi import APIRouter

    if not metrics_tokens:
        raise ValueError("an API's /metrics needs at least one token")

    def respond(answer: ProbeAnswer) -> Response:
        return JSONResponse(answer.body, status_code=answer.status, headers=dict(answer.headers))

    router = APIRouter(include_in_schema=False)

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not presents_token(request.headers.get("authorization", ""), metrics_tokens):
            return respond(unauthorized())
        body, content_type = exposition()
        return Response(body, media_type=content_type)

    @router.get("/healthz")
    async def healthz() -> Response:
        return respond(liveness())

    @router.get("/readyz")
    async def readyz() -> Response:
        return respond(readiness(problems()))

    return router
