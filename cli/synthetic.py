"""``hookline synthetic --port P``: a receiver whose behaviour is chosen by the path, for demos, tests,
load tests and canaries. Register endpoints at the paths you need:

    /ok                200 at once
    /status/<code>     that status (e.g. /status/503, /status/410)
    /slow/<ms>         200 after that many milliseconds
    /flaky/<percent>   500 that share of the time, else 200
    /retry-after/<s>   429 with ``Retry-After: <s>``
    /hang              never answers (until the client gives up)
    /close             closes the connection without answering

Anything else is a 404 naming the paths above. Every request is counted per path (``GET /stats``).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from hookline.shared.runtime import lifecycle

HANG_S = 3600.0
USAGE = "paths: /ok /status/<code> /slow/<ms> /flaky/<percent> /retry-after/<s> /hang /close"


@dataclass(frozen=True)
class Behaviour:
    status: int = 200
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False  # drop the connection instead of answering
    body: str = "ok"


def behaviour(path: str, random_unit: Callable[[], float]) -> Behaviour:
    """What to answer at ``path``; ``random_unit`` gives [0, 1) for /flaky."""
    parts = path.strip("/").split("/")
    match parts:
        case ["ok"]:
            return Behaviour()
        case ["status", code] if code.isdigit() and 200 <= int(code) <= 599:
            return Behaviour(status=int(code), body=f"status {code}")
        case ["slow", ms] if ms.isdigit():
            return Behaviour(delay_s=int(ms) / 1000)
        case ["flaky", percent] if percent.isdigit() and int(percent) <= 100:
            failing = random_unit() * 100 < int(percent)
            return Behaviour(status=500 if failing else 200, body="flaky: failed" if failing else "ok")
        case ["retry-after", seconds] if seconds.isdigit():
            return Behaviour(status=429, headers={"retry-after": seconds}, body="slow down")
        case ["hang"]:
            return Behaviour(delay_s=HANG_S)
        case ["close"]:
            return Behaviour(close=True)
    return Behaviour(status=404, body=USAGE)


def build_app(*, random_unit: Callable[[], float] = random.random) -> web.Application:
    seen: Counter[str] = Counter()

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(dict(seen))

    async def answer(request: web.Request) -> web.StreamResponse:
        await request.read()
        seen[request.path] += 1
        chosen = behaviour(request.path, random_unit)
        if chosen.delay_s:
            await asyncio.sleep(chosen.delay_s)
        if chosen.close:
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)  # never sent: the connection is gone
        return web.Response(status=chosen.status, headers=chosen.headers, text=chosen.body)

    app = web.Application()
    app.router.add_get("/stats", stats)
    app.router.add_route("*", "/{tail:.*}", answer)
    return app


def run(*, host: str, port: int) -> None:
    async def serve() -> None:
        runner = web.AppRunner(build_app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        print(f"synthetic endpoints on http://{host}:{port}/ ({USAGE}); Ctrl-C stops", flush=True)
        try:
            await lifecycle.stop_event().wait()
        finally:
            await runner.cleanup()

    lifecycle.run(serve)
