"""The health monitor's HTTP application: the status API, probes and metrics, around :mod:`monitor`."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import structlog
from fastapi import Depends, FastAPI

from hookline.health_monitor import dashboard, portal, statusapi
from hookline.health_monitor.ingest_api import IngestApi
from hookline.health_monitor.monitor import Monitor, monitoring
from hookline.health_monitor.sessions import Sessions
from hookline.health_monitor.settings import MonitorSettings
from hookline.health_monitor.sinks import AlertSinks, Sink, parse_sinks
from hookline.shared import __version__
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.broker.capacity import CapacityReader
from hookline.shared.outbound.delivery import DeliveryClient
from hookline.shared.runtime import lifecycle
from hookline.shared.runtime import logging as hookline_logging
from hookline.shared.runtime.api import bearer_token_guard, install_error_handlers, probes_router, serve
from hookline.shared.runtime.settings import load, metrics_tokens
from hookline.shared.runtime.supervision import Supervisor
from hookline.shared.state import registry

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class _Connections:
    """What the monitor talks to, open for as long as the app runs."""

    broker: Broker
    capacity: CapacityReader
    alert_sinks: AlertSinks
    ingest_api: IngestApi


@asynccontextmanager
async def _connections(settings: MonitorSettings, sinks: list[Sink]) -> AsyncIterator[_Connections]:
    secret = settings.alert_webhook_secret.get_secret_value() if settings.alert_webhook_secret else None
    async with (
        Broker(
            settings.amqp_url,
            name="hookline-health-monitor",
            connect_timeout_s=settings.connect_timeout_s,
        ) as broker,
        CapacityReader.of(settings) as capacity,
        DeliveryClient(
            # The operator's own URLs, from the settings: not subject to the endpoints' SSRF rules.
            max_connections=8,
            user_agent=f"hookline/{__version__}",
            allow_http=True,
            allow_private=True,
        ) as client,
        AlertSinks(sinks, secret=secret, client=client) as alert_sinks,
        IngestApi(settings.ingest_url) as ingest_api,
    ):
        yield _Connections(broker, capacity, alert_sinks, ingest_api)


@asynccontextmanager
async def _monitor_running(
    settings: MonitorSettings, supervisor: Supervisor, connections: _Connections
) -> AsyncIterator[Monitor]:
    broker = connections.broker
    await topology.declare(broker, settings.retention)
    publisher = Publisher(broker)
    registry_path = settings.state_file("health-monitor", settings.monitor_port).with_suffix(
        ".registry.sqlite"
    )
    async with registry.kept_at(registry_path, vhost=broker.vhost) as endpoint_registry:
        try:
            change_log = await registry.follow(
                broker, publisher, supervisor, endpoint_registry, sync_timeout_s=settings.connect_timeout_s
            )
            async with monitoring(
                settings, broker, publisher, supervisor, change_log, connections.capacity,
                connections.alert_sinks,
            ) as monitor:  # fmt: skip
                log.info("monitor_ready", endpoints=len(change_log.registry))
                yield monitor
        finally:
            # The loops left (the endpoint log's follower among them) stop before the channel they
            # publish on, and before the registry they write closes.
            await supervisor.stop()
            await publisher.close()


def create_app(settings: MonitorSettings) -> FastAPI:
    supervisor = Supervisor()
    try:
        sinks = parse_sinks(settings.alert_webhook_urls)
    except ValueError as exc:
        print(f"hookline: invalid setting HOOKLINE_ALERT_WEBHOOK_URLS: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with _connections(settings, sinks) as connections:
            app.state.broker = connections.broker
            app.state.ingest_api = connections.ingest_api
            async with _monitor_running(settings, supervisor, connections) as monitor:
                app.state.monitor = monitor
                yield

    def problems() -> list[str]:
        monitor: Monitor | None = getattr(app.state, "monitor", None)
        broker: Broker | None = getattr(app.state, "broker", None)
        if monitor is None or broker is None:
            return ["starting"]
        # Not blocked: during an alarm the monitor is where an operator looks (/v1/alerts, /v1/status).
        return ([] if broker.connected else ["broker: not connected"]) + supervisor.problems()

    app = FastAPI(title="hookline health monitor", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(
        statusapi.router, dependencies=[Depends(bearer_token_guard(settings.api_token.get_secret_value()))]
    )
    app.include_router(probes_router(problems, metrics_tokens=metrics_tokens(settings)))
    # The dashboard has its own login (a session cookie), not the bearer guard of the API.
    app.state.sessions = Sessions()
    app.include_router(dashboard.router)
    # The customer portal: a session in the page's path, checked by the ingest at every page.
    app.state.portal_look = portal.Look.of(settings)
    app.add_exception_handler(portal.PortalPageError, portal.problem_page)
    app.include_router(portal.router)
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

    lifecycle.run(run, nice=settings.nice)
