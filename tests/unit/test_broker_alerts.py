"""Which broker alerts fire for which readings: a table over the pure decision."""

from __future__ import annotations

import pytest

from hookline.health_monitor.alerts import AlertPolicy, broker_alerts
from hookline.shared.broker.capacity import BrokerCapacity

POLICY = AlertPolicy(broker_disk_headroom_bytes=5_000_000_000, broker_fd_ratio=0.8)
GB = 1_000_000_000


def reading(**overrides: object) -> BrokerCapacity:
    fields: dict[str, object] = {
        "source": "diagnostics",
        "nodes": ["rabbit@a"],
        "memory_alarm": False,
        "disk_alarm": False,
        "alarms": [],
        "disk_free_bytes": 80 * GB,
        "disk_free_limit_bytes": 50_000_000,
        "fd_used": 100,
        "fd_limit": 1000,
        "queues": 50,
    }
    return BrokerCapacity.model_validate({**fields, **overrides})


@pytest.mark.parametrize(
    ("capacity", "blocked", "expected"),
    [
        pytest.param(reading(), False, set(), id="healthy"),
        pytest.param(None, False, set(), id="unreadable and publishing"),
        pytest.param(None, True, {"broker_blocked"}, id="unreadable, blocked: the connection tells"),
        pytest.param(reading(memory_alarm=True), True, {"broker_memory_alarm"}, id="memory alarm"),
        pytest.param(reading(memory_alarm=True), False, {"broker_memory_alarm"}, id="alarm before the pulse"),
        pytest.param(
            reading(disk_alarm=True, disk_free_bytes=GB, disk_free_limit_bytes=2 * GB),
            True,
            {"broker_disk_alarm"},  # disk low is implied, not said twice
            id="disk alarm",
        ),
        pytest.param(reading(), True, {"broker_blocked"}, id="blocked, no alarm on this node"),
        pytest.param(reading(disk_free_bytes=4 * GB), False, {"broker_disk_low"}, id="disk low"),
        pytest.param(reading(disk_free_bytes=5 * GB + 50_000_000), False, set(), id="disk headroom exactly"),
        pytest.param(reading(fd_used=800), False, {"broker_file_handles"}, id="handles at the ratio"),
        pytest.param(reading(fd_used=799), False, set(), id="handles under the ratio"),
        pytest.param(
            reading(queues=267),
            False,
            {"broker_queue_capacity"},
            id="3.x: three handles per queue at the ratio",
        ),
        pytest.param(reading(queues=266), False, set(), id="3.x: queues just under the ratio"),
        pytest.param(
            reading(queues=800, fd_used=900),
            False,
            {"broker_file_handles", "broker_queue_capacity"},
            id="queues near the handle limit",
        ),
        pytest.param(
            reading(fd_used=None, fd_limit=None, queues=5000), False, set(), id="4.x: no handle numbers"
        ),
        pytest.param(reading(disk_free_bytes=None), False, set(), id="disk unknown"),
    ],
)
def test_broker_alerts(capacity: BrokerCapacity | None, blocked: bool, expected: set[str]) -> None:
    alerts = broker_alerts(capacity, blocked=blocked, policy=POLICY)
    assert {alert.name for alert in alerts} == expected
    assert all(alert.endpoint_id is None and alert.tenant is None for alert in alerts)


def test_the_details_name_the_numbers() -> None:
    [handles, queues] = broker_alerts(reading(fd_used=900, queues=850), blocked=False, policy=POLICY)
    assert "900 of 1000 file handles" in handles.detail
    assert "850 queues for 1000 file handles" in queues.detail
    [disk] = broker_alerts(reading(disk_free_bytes=2 * GB + 50_000_000), blocked=False, policy=POLICY)
    assert "2.0 GB of disk left" in disk.detail
    [memory] = broker_alerts(
        reading(memory_alarm=True, nodes=["rabbit@a", "rabbit@b"]), blocked=True, policy=POLICY
    )
    assert "rabbit@a, rabbit@b" in memory.detail
