"""The health monitor's HTTP application: the status API, probes and metrics, around :mod:`monitor`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from fastapi import Depends, FastAPI

from hookline.health_monitor import status
from hookline.health_monitor.monitor import monitoring
from hookline.shared import __version__, amqp, lifecycle, registry, topology
from hookline.shared import logging as hookline_logging
from hookline.shared.api import bearer_token_guard, install_error_handlers, probes_router, serve
from hookline.shared.settings import MonitorSettings, load

log = structlog.get_logger(__name__)


def create_app(settings: MonitorSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with amqp.connection(
            settings.amqp_url, name="hookline-health-monitor", connect_timeout_s=settings.connect_timeout_s
        ) as connection:
            await topology.declare(connection, event_log_max_age_s=settings.event_log_max_age_s)
            endpoint_registry = registry.EndpointRegistry()
            async with (
                registry.follow(
                    connection, endpoint_registry, sync_timeout_s=settings.connect_timeout_s
                ) as change_log,
                monitoring(settings, connection, change_log) as monitor,
            ):
                app.state.monitor = monitor
                log.info("monitor_ready", endpoints=len(endpoint_registry))
                yield

    app = FastAPI(title="hookline health monitor", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(
        status.router, dependencies=[Depends(bearer_token_guard(settings.api_token.get_secret_value()))]
    )
    app.include_router(probes_router(lambda: getattr(app.state, "monitor", None) is not None))
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
