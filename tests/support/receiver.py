"""A real HTTP receiver on 127.0.0.1 that records every request and answers as a test tells it to."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

#: The longest a request waits for others to be open with it (Reply.hold_until_open).
HOLD_LONGEST_S = 10.0
#: The longest a request waits for its test to release it (Reply.until).
HELD_LONGEST_S = 60.0
#: How long requests still open when the receiver closes are given to finish.
SHUTDOWN_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.time() when it arrived


@dataclass(frozen=True)
class Reply:
    status: int = 204
    headers: dict[str, str] | None = None
    delay_s: float = 0.0
    close: bool = False  # drop the connection without answering
    body: bytes = b""
    # Held until this many requests are open at once (at most HOLD_LONGEST_S), then delay_s more: a
    # concurrency cap is then reached however slowly requests come (they overlap by construction), and
    # one more request let through shows as one more open meanwhile.
    hold_until_open: int = 0
    # Held until the test sets it (at most HELD_LONGEST_S): a write made "while the request is still
    # open" is then made so however slow the machine, where a fixed delay_s only hopes it is.
    until: asyncio.Event | None = None


Responder = Callable[[Received], Reply]


class Receiver:
    def __init__(self, responder: Responder | None = None) -> None:
        self.requests: list[Received] = []
        self.in_flight = 0
        self.max_in_flight = 0  # the most requests that were being answered at once
        self.responder: Responder = responder or (lambda _: Reply())
        self._arrived = asyncio.Condition()
        self._crowded = asyncio.Condition()  # notified when the open requests reach a hold's count
        self._crowds = 0  # how many times they did
        self._runner: web.AppRunner | None = None
        self.port = 0

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def __aenter__(self) -> Receiver:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # At the end of a test, a request still being answered (a scripted delay) is cut off rather than
        # waited for: the dispatcher sees a dropped connection, as from an endpoint that went away.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._runner is not None
        async with self._crowded:  # the test is over: a request still held need not wait for others
            self._crowds += 1
            self._crowded.notify_all()
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        received = Received(
            path=request.path,
            headers={key.lower(): value for key, value in request.headers.items()},
            body=await request.read(),
            at=time.time(),
        )
        reply = self.responder(received)
        async with self._arrived:
            self.requests.append(received)
            self._arrived.notify_all()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if reply.hold_until_open:
                await self._hold(reply.hold_until_open)
            if reply.until is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reply.until.wait(), HELD_LONGEST_S)
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
        finally:
            self.in_flight -= 1
        if reply.close:
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)
        return web.Response(status=reply.status, headers=reply.headers, body=reply.body or None)

    async def _hold(self, count: int) -> None:
        """Until ``count`` requests are open at once (this one among them), or HOLD_LONGEST_S passed."""
        async with self._crowded:
            if self.in_flight >= count:
                self._crowds += 1
                self._crowded.notify_all()
                return
            before = self._crowds
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HOLD_LONGEST_S):
                    await self._crowded.wait_for(lambda: self._crowds > before)

    async def wait_for(
        self, count: int, *, timeout_s: float = 20.0, path: str | None = None
    ) -> list[Received]:
        """Wait until ``count`` requests (to ``path``, if given) have arrived; return them."""
        return await self._wait_until(lambda got: len(got) >= count, timeout_s, path)

    async def wait_for_ids(
        self, ids: set[str], *, timeout_s: float = 20.0, path: str | None = None
    ) -> list[Received]:
        """Wait until every ``webhook-id`` in ``ids`` has arrived (to ``path``, if given).

        Counting requests is not enough where redeliveries are expected (after a broker restart,
        an unacked message comes again and would stand in for one not yet delivered).
        """
        return await self._wait_until(
            lambda got: ids <= {r.headers.get("webhook-id") for r in got}, timeout_s, path
        )

    async def _wait_until(
        self, done: Callable[[list[Received]], bool], timeout_s: float, path: str | None
    ) -> list[Received]:
        def matching() -> list[Received]:
            return [r for r in self.requests if path is None or r.path == path]

        async with asyncio.timeout(timeout_s), self._arrived:
            await self._arrived.wait_for(lambda: done(matching()))
        return matching()
