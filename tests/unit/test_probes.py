"""The probes' answers, decided once in shared/runtime/probes.py for both adapters (the aiohttp probe server of
the dispatcher and the outbox relay, the FastAPI routes of the ingest and the monitor)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hookline.shared.runtime.probes import liveness, readiness, unauthorized

BROKER = "broker: not connected"
LOOP = "consumers: down (the channel closed)"


@pytest.mark.parametrize(
    ("problems", "status", "body"),
    [
        ([], 200, {"status": "ready"}),
        (
            [BROKER],
            503,
            {
                "error": "not_ready",
                "message": f"not ready: {BROKER}",
                "details": [{"field": None, "message": BROKER}],
            },
        ),
        (
            [BROKER, LOOP],
            503,
            {
                "error": "not_ready",
                "message": f"not ready: {BROKER}; {LOOP}",
                "details": [{"field": None, "message": BROKER}, {"field": None, "message": LOOP}],
            },
        ),
    ],
)
def test_ready_only_when_nothing_is_missing(problems: list[str], status: int, body: dict[str, Any]) -> None:
    answer = readiness(problems)
    assert (answer.status, answer.body, dict(answer.headers)) == (status, body, {})
    assert json.loads(json.dumps(answer.body)) == body, "the body is plain JSON"


def test_liveness_and_the_metrics_refusal() -> None:
    assert (liveness().status, liveness().body) == (200, {"status": "ok"})
    refused = unauthorized()
    assert refused.status == 401
    assert refused.body == {
        "error": "unauthorized",
        "message": "a valid bearer token is required",
        "details": [],
    }
    assert dict(refused.headers) == {"WWW-Authenticate": "Bearer"}
