"""``hookline synthetic``: what each path answers (a table), and the real server answering it."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from hookline.cli.synthetic import HANG_S, Behaviour, behaviour, build_app


@pytest.mark.parametrize(
    ("path", "random_unit", "expected"),
    [
        ("/ok", 0.5, Behaviour()),
        ("/status/503", 0.5, Behaviour(status=503, body="status 503")),
        ("/status/410", 0.5, Behaviour(status=410, body="status 410")),
        ("/status/99", 0.5, None),
        ("/slow/2000", 0.5, Behaviour(delay_s=2.0)),
        ("/flaky/25", 0.24, Behaviour(status=500, body="flaky: failed")),
        ("/flaky/25", 0.25, Behaviour()),
        ("/flaky/101", 0.0, None),
        ("/retry-after/3", 0.5, Behaviour(status=429, headers={"retry-after": "3"}, body="slow down")),
        ("/hang", 0.5, Behaviour(delay_s=HANG_S)),
        ("/close", 0.5, Behaviour(close=True)),
        ("/nothing/here", 0.5, None),
    ],
)
def test_behaviour(path: str, random_unit: float, expected: Behaviour | None) -> None:
    found = behaviour(path, lambda: random_unit)
    if expected is None:
        assert found.status == 404
        assert "/flaky/<percent>" in found.body
    else:
        assert found == expected


async def test_the_server_answers_as_the_path_says() -> None:
    async with TestClient(TestServer(build_app(random_unit=lambda: 0.0))) as client:
        assert (await client.post("/ok", data=b"{}")).status == 200
        assert (await client.post("/status/503")).status == 503
        limited = await client.post("/retry-after/3")
        assert (limited.status, limited.headers["retry-after"]) == (429, "3")
        assert (await client.post("/flaky/50")).status == 500  # the random unit is 0.0: always failing
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await client.post("/close")
        with pytest.raises(asyncio.TimeoutError):
            await client.post("/hang", timeout=aiohttp.ClientTimeout(total=0.2))
        assert await (await client.get("/stats")).json() == {
            "/ok": 1, "/status/503": 1, "/retry-after/3": 1, "/flaky/50": 1, "/close": 1, "/hang": 1,
        }  # fmt: skip
