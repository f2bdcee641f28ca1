"""Deliveries through an egress proxy (HOOKLINE_EGRESS_PROXY, for static source addresses): a real
forward proxy on 127.0.0.1 relays them, and the SSRF checks still apply to the targets although the
proxy, not hookline, connects to them (the proxy's own private address is allowed)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from hookline.shared.outbound.delivery import DeliveryClient, ErrorKind

pytestmark = pytest.mark.integration


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


@pytest.fixture
async def target() -> AsyncIterator[tuple[str, list[str]]]:
    """The endpoint: records the path of each POST it gets."""
    seen: list[str] = []

    async def hook(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/{tail:.*}", hook)
    runner, port = await _serve(app)
    yield f"http://127.0.0.1:{port}", seen
    await runner.cleanup()


@pytest.fixture
async def proxy() -> AsyncIterator[tuple[str, list[str]]]:
    """A forward HTTP proxy: requests in absolute form are relayed; returns the URLs it relayed."""
    relayed: list[str] = []

    async def relay(request: web.Request) -> web.Response:
        url = str(request.url)
        relayed.append(url)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "proxy-connection")}
        async with (
            aiohttp.ClientSession() as session,
            session.request(request.method, url, data=await request.read(), headers=headers) as answer,
        ):
            return web.Response(status=answer.status, body=await answer.read())

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", relay)
    runner, port = await _serve(app)
    yield f"http://127.0.0.1:{port}", relayed
    await runner.cleanup()


async def test_deliveries_go_through_the_proxy(
    target: tuple[str, list[str]], proxy: tuple[str, list[str]]
) -> None:
    base, seen = target
    proxy_url, relayed = proxy
    async with DeliveryClient(
        max_connections=4, user_agent="t", allow_http=True, allow_private=True, proxy=proxy_url
    ) as client:
        result = await client.post(f"{base}/hook", b"{}", {"content-type": "application/json"}, timeout_s=5)
    assert result.status == 204, result.detail
    assert relayed == [f"{base}/hook"]
    assert seen == ["/hook"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_a_private_target_is_refused_before_it_reaches_the_proxy(
    target: tuple[str, list[str]], proxy: tuple[str, list[str]], host: str
) -> None:
    """The proxy itself is on 127.0.0.1 and may be used; a target that is (or resolves to) a private
    address is refused here, by a literal check or by resolving it first, and the proxy sees nothing."""
    base, seen = target
    proxy_url, relayed = proxy
    port = base.rsplit(":", 1)[1]
    async with DeliveryClient(
        max_connections=4, user_agent="t", allow_http=True, allow_private=False, proxy=proxy_url
    ) as client:
        result = await client.post(f"http://{host}:{port}/hook", b"{}", {}, timeout_s=5)
    assert result.error is ErrorKind.REFUSED_TARGET, result.detail
    assert relayed == []
    assert seen == []
