"""Micro-benchmark of the candidate delivery clients against the same receiver, in one process each.

Usage: python -m bench.clients CLIENT N CONCURRENCY URL  (CLIENT: httpx | httpx-aiohttp | aiohttp)
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable

import uvloop

BODY = json.dumps({"data": {"x": "a" * 1000}}).encode()
HEADERS = {"content-type": "application/json", "webhook-id": "evt_bench"}


async def run(client: str, count: int, concurrency: int, url: str) -> float:
    semaphore = asyncio.Semaphore(concurrency)
    post: Callable[[], Awaitable[None]]
    if client == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))

        async def post() -> None:
            async with session.post(url, data=BODY, headers=HEADERS) as response:
                await response.read()

        close: Callable[[], Awaitable[None]] = session.close
    else:
        import httpx

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        if client == "httpx-aiohttp":
            from httpx_aiohttp import AiohttpTransport

            http = httpx.AsyncClient(transport=AiohttpTransport(), limits=limits)
        else:
            http = httpx.AsyncClient(limits=limits)

        async def post() -> None:
            response = await http.post(url, content=BODY, headers=HEADERS)
            await response.aread()

        close = http.aclose

    async def one() -> None:
        async with semaphore:
            await post()

    await asyncio.gather(*(one() for _ in range(min(200, count))))  # warm the connections
    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    elapsed_s = time.perf_counter() - started
    await close()
    return count / elapsed_s


if __name__ == "__main__":
    rate = uvloop.run(run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
    print(json.dumps({"client": sys.argv[1], "requests_per_s": rate}))
