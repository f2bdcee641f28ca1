"""The health monitor's HTTP application: probes and metrics for now; it follows the endpoint log so
that it knows every endpoint from its start."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from fastapi import FastAPI

from hookline.shared import __version__, amqp, lifecycle, registry, topology
from hookline.shared import logging as hookline_logging
from hookline.shared.api import install_error_handlers, probes_router, serve
from hookline.shared.settings import MonitorSettings, load

log = structlog.get_logger(__name__)


def create_app(settings: MonitorSettings) -> FastAPI:
    ready = False

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nonlocal ready
        async with amqp.connection(
            settings.amqp_url, name="hookline-health-monitor", connect_timeout_s=settings.connect_timeout_s
        ) as connection:
            await topology.declare(connection, event_log_max_age_s=settings.event_log_max_age_s)
            endpoint_registry = registry.EndpointRegistry()
            async with registry.follow(
                connection, endpoint_registry, sync_timeout_s=settings.connect_timeout_s
            ):
                ready = True
                log.info("monitor_ready", endpoints=len(endpoint_registry))
                yield
                ready = False

    app = FastAPI(title="hookline health monitor", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(probes_router(lambda: ready))
    return app


def main() -> None:
    settings = load(MonitorSettings)
    hookline_logging.configure(service="health-monitor", level=settings.log_level)

    async def run() -> None:
        await serve(
            create_app(settings),
            host=settings.monitor_host,
            port=settings.monitor_port,
            grace_s=settings.shutdown_grace_s,
        )

    lifecycle.run(run)
