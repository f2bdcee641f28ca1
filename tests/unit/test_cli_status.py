"""``hookline status`` renders the monitor's answers through the monitor's own models."""

from __future__ import annotations

from typing import Any

import pytest

from hookline.cli.admin import status_text
from hookline.shared.contracts.control import BreakerState
from hookline.shared.contracts.status import AlertView, EndpointHealthView, Percentiles, Summary

SUMMARY: dict[str, Any] = {
    "pending": 3, "awaiting_retry": 2, "in_flight": 1, "dead_letter": 4, "delivered_last_hour": 1200,
    "failed_last_hour": 7, "oldest_pending_age_s": 300.0, "mean_delivery_ms": 12.5, "endpoints": 1,
    "breakers_open": 1, "alerts_firing": 1, "dispatchers": 2, "leader": True,
    "broker": {"blocked": False, "capacity": None},
}  # fmt: skip


def endpoint(**changes: Any) -> EndpointHealthView:
    fields: dict[str, Any] = {
        "endpoint_id": "ep_1", "tenant": "acme", "status": "active", "breaker_state": BreakerState.OPEN,
        "breaker_cooldown_s": 300.0, "consecutive_failures": 10, "slow": True, "p50_ms": 40.0, "p95_ms": 2400.0,
        "p99_ms": None, "samples": 120, "last_5m": Percentiles(p50_ms=50.0, p95_ms=2600.0, p99_ms=None, samples=20),
        "success_rate": 0.925, "timeout_rate": None, "attempts": 120, "dead_lettered": 0, "retry_depth": 3,
        "queue_depth": None, "oldest_pending_age_s": 7300.0,
    }  # fmt: skip
    fields.update(changes)
    return EndpointHealthView(**fields)


def test_the_summary_a_row_per_endpoint_and_the_alerts() -> None:
    alert = AlertView(alert="breaker_open", endpoint_id="ep_1", tenant="acme", detail="circuit breaker open")
    text = status_text(Summary.model_validate(SUMMARY), [endpoint()], [alert]).splitlines()
    assert text[0].startswith("pending 3  awaiting retry 2  in flight 1  dead letters 4  delivered/1h 1200")
    assert text[0].endswith("oldest pending 5m  mean 12.5 ms  dispatchers 2  monitor leader")
    assert (
        text[1]
        == "broker: taking publishes  (its numbers are not readable: HOOKLINE_RABBITMQ_MANAGEMENT_URL)"
    )
    row = text[4].split()
    assert row == [
        "ep_1",
        "acme",
        "open",
        "40.0",
        "2,400",
        "-",
        "2,600",
        "120",
        "92.5",
        "-",
        "-",
        "2.0h",
        "slow",
    ]
    assert text[-1] == "ALERT breaker_open ep_1: circuit breaker open"


@pytest.mark.parametrize(
    ("broker", "line"),
    [
        ({"blocked": True, "capacity": None}, "broker: REFUSING PUBLISHES  (its numbers"),
        (
            {"blocked": False, "capacity": {
                "source": "management", "nodes": ["rabbit@a"], "memory_alarm": True, "disk_alarm": False,
                "alarms": ["memory"], "disk_free_bytes": 5_500_000_000, "disk_free_limit_bytes": 50_000_000,
                "fd_used": 900, "fd_limit": 1024, "queues": 310,
            }},
            "broker: taking publishes  MEMORY  disk free 5.5 GB  file handles 900/1024  queues 310",
        ),
    ],
)  # fmt: skip
def test_the_brokers_line(broker: dict[str, Any], line: str) -> None:
    text = status_text(Summary.model_validate({**SUMMARY, "broker": broker}), [], [])
    assert text.splitlines()[1].startswith(line)
    assert text.splitlines()[-1] == "no alerts firing"
