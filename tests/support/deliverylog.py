"""What hookline recorded of its attempts, read from the delivery log over the ingest's API.

Tests about timing assert on these: the times hookline stamped and the times it decided (the next
attempt, a pause), which do not depend on how busy the machine is, where the arrival times a receiver
notes do (a receiver or dispatcher held up for a moment makes two requests look closer or further
apart than hookline made them).
"""

from __future__ import annotations

import asyncio
import itertools
from datetime import datetime
from typing import Any

import pytest

from support.system import System
from support.waiting import eventually

Attempt = dict[str, Any]  # an attempt as GET /v1/events/{id} and GET /v1/endpoints/{id}/attempts show it


def moment_s(attempt: Attempt, field: str) -> float:
    """A time of the attempt (``at``, ``next_attempt_at``, ``paused_until``) in unix seconds."""
    return datetime.fromisoformat(attempt[field]).timestamp()


def sent_s(attempt: Attempt) -> float:
    """When the request went out, by hookline's own clock: the attempt's end (``at``) less its duration.

    Never earlier than the moment the dispatcher let the attempt go (its timing starts after that, and
    ``at`` is stamped after the answer), so "not sent before X" holds of it whenever it holds of hookline.
    """
    return moment_s(attempt, "at") - attempt["duration_ms"] / 1000


async def attempts_of(
    system: System, event_id: str, endpoint_id: str, *, at_least: int = 1, timeout_s: float = 30
) -> list[Attempt]:
    """The event's attempts at the endpoint in the order they were made, once ``at_least`` are logged
    (the log follows the dispatchers' telemetry, a moment behind)."""

    def read() -> list[Attempt]:
        with system.api() as api:
            answer = api.get(f"/v1/events/{event_id}")
        if answer.status_code != 200:
            return []
        courses = [c for c in answer.json()["endpoints"] if c["endpoint_id"] == endpoint_id]
        return [a for course in courses for a in course["attempts"]]

    async def enough() -> list[Attempt] | None:
        found = await asyncio.to_thread(read)
        return found if len(found) >= at_least else None

    found = await eventually(enough, timeout_s=timeout_s, explain=lambda: f"{read()}")
    return sorted(found, key=lambda a: (a["attempt"], moment_s(a, "at")))


async def attempts_at(
    system: System, endpoint_id: str, *, at_least: int, timeout_s: float = 30
) -> list[Attempt]:
    """Every attempt at the endpoint (up to 500), in the order they were sent, once ``at_least`` are
    logged."""

    def read() -> list[Attempt]:
        with system.api() as api:
            answer = api.get(f"/v1/endpoints/{endpoint_id}/attempts", params={"limit": 500})
        assert answer.status_code == 200, answer.text
        found: list[Attempt] = answer.json()["data"]
        return found

    async def enough() -> list[Attempt] | None:
        found = await asyncio.to_thread(read)
        return found if len(found) >= at_least else None

    found = await eventually(enough, timeout_s=timeout_s, explain=lambda: f"{len(read())} logged")
    return sorted(found, key=sent_s)


def assert_retried_after(attempts: list[Attempt], delays_s: list[float]) -> None:
    """Each failed attempt but the last was followed by a retry due ``delays_s`` later, as hookline
    decided it (``next_attempt_at`` less ``at``, exact without jitter), and the retry was not sent
    before it was due."""
    assert len(attempts) == len(delays_s) + 1, attempts
    for (failed, retry), delay_s in zip(itertools.pairwise(attempts), delays_s, strict=True):
        due_s = moment_s(failed, "next_attempt_at")
        assert due_s - moment_s(failed, "at") == pytest.approx(delay_s, abs=0.002), failed
        assert sent_s(retry) >= due_s - 0.002, f"attempt {retry['attempt']} sent before it was due: {retry}"
