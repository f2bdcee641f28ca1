"""The dispatcher's Prometheus metrics and the small HTTP server that exposes them with its probes."""

from __future__ import annotations

import functools
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

ATTEMPTS = prometheus_client.Counter(
    "hookline_delivery_attempts", "Delivery attempts by outcome.", ["outcome"]
)
ATTEMPT_SECONDS = prometheus_client.Histogram(
    "hookline_delivery_attempt_seconds",
    "Duration of delivery attempts (request start to response headers, or the error).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 30),
)


@functools.cache
def attempts(outcome: str) -> prometheus_client.Counter:
    """The attempt counter of one outcome (``labels()`` looks it up under a lock every time)."""
    return ATTEMPTS.labels(outcome)


DEAD_LETTERS = prometheus_client.Counter(
    "hookline_dead_letters", "Messages dead-lettered, by reason.", ["reason"]
)
# Read when scraped (service.py sets the function): counting on the delivery path costs a lock twice.
IN_FLIGHT = prometheus_client.Gauge("hookline_dispatcher_in_flight", "Deliveries being handled now.")
TELEMETRY_DROPPED = prometheus_client.Counter(
    "hookline_telemetry_dropped_records",
    "Telemetry records dropped: the broker was unreachable or refusing publishes (an alarm).",
)
CONSUMERS = prometheus_client.Gauge(
    "hookline_dispatcher_consumers", "Endpoint queues this dispatcher consumes."
)
QUEUES_REDECLARED = prometheus_client.Counter(
    "hookline_endpoint_queues_redeclared", "Endpoint queues found missing and declared again."
)
BREAKERS_EXPIRED = prometheus_client.Counter(
    "hookline_breakers_expired", "Open breakers closed here because no health monitor renewed them."
)


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
