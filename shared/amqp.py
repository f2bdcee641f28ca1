"""The broker connection every service opens: robust (it reconnects by itself), named, bounded at start."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aio_pika
import structlog
from aio_pika.abc import AbstractRobustConnection

log = structlog.get_logger(__name__)

# Errors that mean "the broker is not there yet" at start; anything else is a configuration error.
_CONNECT_ERRORS = (ConnectionError, OSError, asyncio.TimeoutError, aio_pika.exceptions.AMQPConnectionError)

#: A publish or broker call that raised one of these did not happen (or is unknown): try again later.
#: ChannelInvalidStateError (a RuntimeError) is what a robust channel raises while it reconnects.
BROKER_ERRORS: tuple[type[BaseException], ...] = (
    aio_pika.exceptions.AMQPError,
    aio_pika.exceptions.ChannelInvalidStateError,
    asyncio.TimeoutError,
    ConnectionError,
)


@asynccontextmanager
async def connection(
    url: str, *, name: str, connect_timeout_s: float
) -> AsyncIterator[AbstractRobustConnection]:
    """Connect, retrying for up to ``connect_timeout_s`` (each failure logged), and close on exit."""
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            conn = await aio_pika.connect_robust(
                url,
                client_properties={"connection_name": f"{name}:{os.getpid()}"},
                timeout=min(10.0, connect_timeout_s),
            )
            break
        except _CONNECT_ERRORS as exc:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                log.error("broker_unreachable", error=type(exc).__name__, detail=str(exc))
                raise SystemExit(1) from None
            log.warning("broker_connect_retry", error=type(exc).__name__, remaining_s=round(remaining_s, 1))
            await asyncio.sleep(min(1.0, remaining_s))
    try:
        yield conn
    finally:
        await conn.close()
