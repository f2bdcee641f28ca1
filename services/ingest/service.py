"""The ingest process: its HTTP application (middleware, :mod:`routes`, probes) around
:mod:`lifespan`, which opens and runs what the routes use."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from fastapi import FastAPI

from hookline.ingest import lifespan, routes
from hookline.ingest.bodylimit import BodyLimit
from hookline.ingest.settings import IngestSettings
from hookline.ingest.state import IngestState
from hookline.shared import __version__
from hookline.shared.runtime import lifecycle
from hookline.shared.runtime import logging as hookline_logging
from hookline.shared.runtime.api import install_error_handlers, probes_router, serve
from hookline.shared.runtime.settings import load, metrics_tokens

log = structlog.get_logger(__name__)

# Enough for an event at the payload limit plus its envelope (ids, type, timestamps).
_ENVELOPE_SLACK_BYTES = 8192


def create_app(settings: IngestSettings) -> FastAPI:
    @asynccontextmanager
    async def running(app: FastAPI) -> AsyncIterator[None]:
        async with lifespan.running(settings) as state:
            app.state.ingest = state
            log.info(
                "ingest_ready",
                endpoints=len(state.registry),
                dead_letters=await state.dead_letters_index.count(),
            )
            yield

    app = FastAPI(title="hookline ingest", version=__version__, lifespan=running)
    install_error_handlers(app)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_payload_bytes + _ENVELOPE_SLACK_BYTES,
        larger={"/v1/events/batch": (settings.max_batch_bytes, "HOOKLINE_MAX_BATCH_BYTES")},
    )
    routes.include(app)
    app.include_router(probes_router(lambda: _problems(app), metrics_tokens=metrics_tokens(settings)))
    return app


def _problems(app: FastAPI) -> list[str]:
    state: IngestState | None = getattr(app.state, "ingest", None)
    return ["starting"] if state is None else state.problems()


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

    lifecycle.run(run, nice=settings.nice)
