"""``hookline receive``: a webhook receiver for trying hookline locally.

Prints one line per delivery (id, attempt time, whether the signature verifies) and answers with the
status you choose, so you can watch deliveries arrive, then make the endpoint fail and watch retries.
"""

from __future__ import annotations

import time

from aiohttp import web

from hookline.shared.outbound import signing
from hookline.shared.runtime import lifecycle

TOLERANCE_S = 300


def _verdict(request_headers: dict[str, str], body: bytes, secret: str | None) -> str:
    if secret is None:
        return "unchecked (pass --secret to verify)"
    try:
        timestamp_s = int(request_headers.get("webhook-timestamp", ""))
    except ValueError:
        return "INVALID: no webhook-timestamp"
    if abs(time.time() - timestamp_s) > TOLERANCE_S:
        return "INVALID: timestamp too far from now"
    message_id = request_headers.get("webhook-id", "")
    header = request_headers.get("webhook-signature", "")
    return "valid" if signing.verify(secret, message_id, timestamp_s, body, header) else "INVALID signature"


def build_app(*, status: int, secret: str | None) -> web.Application:
    async def receive(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {key.lower(): value for key, value in request.headers.items()}
        print(
            f"{time.strftime('%H:%M:%S')} {request.method} {request.path} id={headers.get('webhook-id')} "
            f"bytes={len(body)} signature={_verdict(headers, body, secret)} -> {status}",
            flush=True,
        )
        return web.Response(status=status)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", receive)
    return app


def run(*, host: str, port: int, status: int, secret: str | None) -> None:
    async def serve() -> None:
        runner = web.AppRunner(build_app(status=status, secret=secret), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        print(f"receiving on http://{host}:{port}/ and answering {status}; Ctrl-C stops", flush=True)
        try:
            await lifecycle.stop_event().wait()
        finally:
            await runner.cleanup()

    lifecycle.run(serve)
