"""The small HTTP server of a service without an API (a dispatcher, an outbox relay): ``/metrics`` for
Prometheus, ``/healthz`` and ``/readyz`` for the orchestrator."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import prometheus_client
import structlog
from aiohttp import web
from pydantic import SecretStr

from hookline.shared.bearer import UNAUTHORIZED_MESSAGE, presents_token
from hookline.shared.models import ErrorBody

log = structlog.get_logger(__name__)


@asynccontextmanager
async def probe_server(
    host: str, port: int, *, problems: Callable[[], list[str]], metrics_token: SecretStr | None = None
) -> AsyncIterator[int]:
    """Serve ``/metrics``, ``/healthz`` and ``/readyz``; yields the bound port (``port=0`` picks one).
    With ``metrics_token``, ``/metrics`` answers only that bearer token (the probes stay open for the
    orchestrator); without, it is open: its series name no endpoint or tenant."""
    accepted = (metrics_token.get_secret_value(),) if metrics_token else ()

    async def metrics(request: web.Request) -> web.Response:
        if accepted and not presents_token(request.headers.get("authorization", ""), accepted):
            body = ErrorBody(error="unauthorized", message=UNAUTHORIZED_MESSAGE)
            return web.json_response(
                body.model_dump(mode="json"), status=401, headers={"WWW-Authenticate": "Bearer"}
            )
        return web.Response(
            body=prometheus_client.generate_latest(),
            headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST},
        )

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        found = problems()
        if not found:
            return web.json_response({"status": "ready"})
        return web.json_response(
            {
                "error": "not_ready",
                "message": "not ready: " + "; ".join(found),
                "details": [{"field": None, "message": problem} for problem in found],
            },
            status=503,
        )

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
