"""The probe routes every service serves: ``/healthz`` and ``/readyz`` for the orchestrator, ``/metrics``
for Prometheus.

What they answer is decided once, here, as plain values (:class:`ProbeAnswer`, :class:`Exposition`);
two adapters serve them: :func:`probe_server` here, the small aiohttp server of a service without an
API (a dispatcher, an outbox relay), and :func:`hookline.shared.runtime.api.probes_router`, the routes on the
listener of a service with a FastAPI API (the ingest, the monitor).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import prometheus_client
import structlog
from aiohttp import web
from pydantic import SecretStr

from hookline.shared.contracts.models import ErrorBody, ErrorDetail
from hookline.shared.runtime.bearer import UNAUTHORIZED_MESSAGE, presents_token

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
