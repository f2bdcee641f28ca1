"""The ingest HTTP application and its lifespan: one broker connection, the endpoint log, the routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from fastapi import Depends, FastAPI

from hookline.ingest import deadletters, endpoints, events, replay
from hookline.ingest.auth import parse_tenant_tokens, principal
from hookline.ingest.state import IngestState
from hookline.shared import __version__, amqp, lifecycle, registry, topology
from hookline.shared import logging as hookline_logging
from hookline.shared.api import BodyLimit, install_error_handlers, probes_router, serve
from hookline.shared.deadletters import DeadLetterIndex
from hookline.shared.delivery import DeliveryClient
from hookline.shared.sealing import Sealer
from hookline.shared.settings import IngestSettings, load
from hookline.shared.streams import StreamFollower

log = structlog.get_logger(__name__)

# Enough for an event at the payload limit plus its envelope (ids, type, timestamps).
_ENVELOPE_SLACK_BYTES = 8192


def create_app(settings: IngestSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with amqp.connection(
            settings.amqp_url, name="hookline-ingest", connect_timeout_s=settings.connect_timeout_s
        ) as connection:
            await topology.declare(connection, event_log_max_age_s=settings.event_log_max_age_s)
            publisher = await connection.channel(publisher_confirms=True, on_return_raises=True)
            admin = await connection.channel(publisher_confirms=True, on_return_raises=True)
            endpoint_registry = registry.EndpointRegistry()
            tenant_tokens = parse_tenant_tokens(
                settings.tenant_tokens.get_secret_value() if settings.tenant_tokens else None
            )
            dead_letter_index = DeadLetterIndex()
            dead_letter_log = StreamFollower(connection, topology.DEAD_LETTER_STREAM, dead_letter_index.apply)
            async with (
                registry.follow(
                    connection, endpoint_registry, sync_timeout_s=settings.connect_timeout_s
                ) as change_log,
                DeliveryClient(
                    max_connections=32,
                    user_agent=f"hookline/{__version__}",
                    allow_http=settings.allow_http,
                    allow_private=settings.allow_private_targets,
                ) as client,
            ):
                await dead_letter_log.start()
                await dead_letter_log.sync(timeout_s=settings.connect_timeout_s)
                app.state.ingest = IngestState(
                    settings=settings,
                    connection=connection,
                    change_log=change_log,
                    registry=endpoint_registry,
                    publisher=publisher,
                    events=await topology.events_exchange(publisher),
                    dead_letters=await topology.dead_letter_exchange(admin),
                    admin=admin,
                    dead_letters_log=dead_letter_log,
                    dead_letters_index=dead_letter_index,
                    client=client,
                    sealer=Sealer(settings.secret_key.get_secret_value() if settings.secret_key else None),
                    tenant_tokens=tenant_tokens,
                )
                log.info(
                    "ingest_ready", endpoints=len(endpoint_registry), dead_letters=len(dead_letter_index)
                )
                try:
                    yield
                finally:
                    await dead_letter_log.stop()

    app = FastAPI(title="hookline ingest", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_payload_bytes + _ENVELOPE_SLACK_BYTES)
    # Every /v1 route needs a token; the routes then limit a tenant token to its own tenant.
    guard = Depends(principal)
    app.include_router(events.router, dependencies=[guard])
    app.include_router(endpoints.router, dependencies=[guard])
    app.include_router(replay.router, dependencies=[guard])
    app.include_router(deadletters.router, dependencies=[guard])
    app.include_router(probes_router(lambda: _ready(app)))
    return app


def _ready(app: FastAPI) -> bool:
    state: IngestState | None = getattr(app.state, "ingest", None)
    return state is not None and state.is_ready()


def main() -> None:
    settings = load(IngestSettings)
    hookline_logging.configure(service="ingest", level=settings.log_level)

    async def run() -> None:
        await serve(
            create_app(settings),
            host=settings.ingest_host,
            port=settings.ingest_port,
            grace_s=settings.shutdown_grace_s,
        )

    lifecycle.run(run)
