"""An ingest answers for a new endpoint once every live dispatcher has applied its record."""

from __future__ import annotations

import asyncio
import time

from hookline.ingest.replicas import LIVE_S, Replicas
from hookline.shared.contracts.telemetry import Heartbeat


def _beat(
    dispatcher_id: str, applied: int | None, *, age_s: float = 0.0, stopping: bool = False
) -> Heartbeat:
    return Heartbeat(
        at_s=time.time() - age_s, dispatcher_id=dispatcher_id, in_flight=0, consumers=0,
        applied_offset=applied, stopping=stopping,
    )  # fmt: skip


def test_who_is_waited_for() -> None:
    replicas = Replicas()
    replicas.observe(_beat("behind", 9))
    replicas.observe(_beat("caught-up", 10))
    replicas.observe(_beat("old-version", None))  # says nothing of its offset: not waited for
    replicas.observe(_beat("stopping", 3, stopping=True))
    replicas.observe(_beat("silent", 1, age_s=LIVE_S + 1))  # read while catching up: not live
    assert replicas.lagging(10, now_s=time.time()) == ["behind"]
    assert replicas.lagging(9, now_s=time.time()) == []
    # One that stops being heard from is not waited for once it is no longer live.
    assert replicas.lagging(10, now_s=time.time() + LIVE_S + 1) == []


async def test_the_wait_ends_when_the_last_one_catches_up_or_at_the_deadline() -> None:
    replicas = Replicas()
    replicas.observe(_beat("d1", 4))
    waiting = asyncio.create_task(replicas.applied(5, timeout_s=30))
    await asyncio.sleep(0)
    assert not waiting.done()
    replicas.observe(_beat("d1", 5))
    assert await asyncio.wait_for(waiting, 5) == []
    replicas.observe(_beat("d2", 1))
    assert await replicas.applied(5, timeout_s=0.05) == ["d2"]  # still behind: named, not waited for longer
