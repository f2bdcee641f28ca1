"""Canaries with the real services: the leading monitor publishes one every half second to the canary
tenant's endpoint; its latency is exported; a failing endpoint fires canary_failed, a slow one
canary_late; both resolve once canaries arrive again."""

from __future__ import annotations

import time

import httpx
import pytest
from support.monitoring import AUTH, get_json
from support.receiver import Receiver, Reply
from support.system import System
from support.waiting import eventually

pytestmark = pytest.mark.e2e

SYSTEM_ENV = {
    "HOOKLINE_CANARY_INTERVAL_S": "0.5",
    "HOOKLINE_CANARY_LATE_S": "3",
    "HOOKLINE_TICK_S": "0.2",
    "HOOKLINE_RETRY_SCHEDULE_S": "1",
    "HOOKLINE_BREAKER_FAILURE_THRESHOLD": "1000",
}


async def test_canaries_measure_the_whole_path_and_say_when_it_breaks(
    system: System, receiver: Receiver
) -> None:
    status, delay_s = 204, 0.0
    receiver.responder = lambda _: Reply(status=status, delay_s=delay_s)
    created_s = time.time()
    canary = system.add_endpoint("canary", receiver.url("/canary"), ["hookline.canary"])

    async def latency() -> float | None:
        async with httpx.AsyncClient(base_url=system.monitor.base_url, headers=AUTH, timeout=10) as client:
            response = await client.get("/metrics")
        assert response.status_code == 200, response.text
        text = response.text
        for line in text.splitlines():
            if line.startswith("hookline_canary_latency_seconds{") and canary["id"] in line:
                return float(line.rsplit(" ", 1)[1])
        return None

    measured = await eventually(latency, timeout_s=20)
    # Seconds, from a canary published after the endpoint existed to its delivery: no more than the
    # time since (a stopwatch bound would measure the machine).
    assert 0 <= measured <= time.time() - created_s
    arrived = await receiver.wait_for(2, path="/canary")
    assert all(r.headers["webhook-id"].startswith("evt_") for r in arrived)

    async def firing() -> set[str]:
        # The canary alerts only: five seconds per canary may also make the endpoint's p95 over five
        # minutes slow (slow_endpoint), which rightly lasts longer than the canaries' lateness.
        return {
            a["alert"]
            for a in await get_json(system.monitor, "/v1/alerts") or []
            if a["endpoint_id"] == canary["id"] and a["alert"].startswith("canary_")
        }

    async def fires(name: str) -> bool:
        return name in await firing()

    async def quiet() -> bool:
        return not await firing()

    status = 503
    await eventually(lambda: fires("canary_failed"), timeout_s=20)
    status = 204
    await eventually(quiet, timeout_s=20)

    delay_s = 5.0  # answered, but each canary arrives 5 s after it was sent: later than 3 s
    await eventually(lambda: fires("canary_late"), timeout_s=20)
    assert "canary_failed" not in await firing()
    delay_s = 0.0
    await eventually(quiet, timeout_s=30)
