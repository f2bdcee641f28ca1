"""The ingest's routes: every ``/v1`` route needs a token (the routes then limit a tenant token to its
own tenant), but polling (the endpoint's ``poll_token``) and opening a portal link (the link)."""

from __future__ import annotations

from fastapi import Depends, FastAPI

from hookline.ingest import (
    audit,
    auth,
    endpoints,
    events,
    eventtypes,
    filtertest,
    polling,
    portalsessions,
    quotas,
    redrive,
    replay,
    testevents,
    tokens,
    tracking,
    transformtest,
)


def include(app: FastAPI) -> None:
    guard = Depends(auth.principal)
    app.include_router(events.router, dependencies=[guard])
    app.include_router(endpoints.router, dependencies=[guard])
    app.include_router(testevents.router, dependencies=[guard])
    app.include_router(filtertest.router, dependencies=[guard])
    app.include_router(transformtest.router, dependencies=[guard])
    app.include_router(polling.router)  # its own credential: the endpoint's poll_token
    app.include_router(polling.admin_router, dependencies=[guard])
    app.include_router(eventtypes.router, dependencies=[guard])
    app.include_router(replay.router, dependencies=[guard])
    app.include_router(redrive.router, dependencies=[guard])
    app.include_router(tracking.router, dependencies=[guard])
    app.include_router(auth.router, dependencies=[guard])
    app.include_router(tokens.router, dependencies=[guard])
    app.include_router(portalsessions.router, dependencies=[guard])
    app.include_router(portalsessions.open_router)  # its own credential: the link
    app.include_router(quotas.router, dependencies=[guard])
    app.include_router(audit.router, dependencies=[guard])
