"""The delivery log stays under HOOKLINE_DELIVERY_LOG_MAX_BYTES: past it, the oldest rows go first."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from hookline.ingest.deliverylog import DeliveryLog
from hookline.shared.contracts.headers import Header
from hookline.shared.contracts.telemetry import AttemptRecord, batch

NOW_S = 1_800_000_000.0


@dataclass
class Record:
    """What a stream follower hands a view."""

    body: bytes
    headers: Mapping[str, Any] = field(default_factory=dict)
    message_id: str | None = None
    timestamp: datetime | None = None
    routing_key: str | None = None
    user_id: str | None = None


def attempt(n: int) -> AttemptRecord:
    return AttemptRecord(
        at_s=NOW_S - 3600 + n,
        dispatcher_id="d:1",
        event_id=f"evt_{n:026d}",
        endpoint_id="ep_" + "0" * 26,
        tenant="acme",
        type="order.created",
        attempt=1,
        outcome="success",
        status=200,
        error=None,
        duration_ms=12.0,
        first_attempt_at_s=NOW_S - 3600 + n,
        attempt_kind="delivery",
        response_headers={"content-type": "text/plain"},
        response_body="thanks " * 40,
    )


async def fill(log: DeliveryLog, count: int) -> None:
    for offset in range(count // 100):
        records = [attempt(offset * 100 + i) for i in range(100)]
        log.attempts.apply(Record(batch.dump_json(records), {"x-stream-offset": offset}))
        event = {"id": f"evt_{offset:026d}", "tenant": "acme", "type": "order.created", "data": {}}
        headers = {"x-stream-offset": offset, Header.ACCEPTED_AT_MS: int((NOW_S - 3600 + offset) * 1000)}
        log.events.apply(
            Record(orjson.dumps(event), headers, routing_key=f"{event['tenant']}.{event['type']}")
        )
    await log.attempts.flush()
    await log.events.flush()


async def test_past_its_budget_the_log_forgets_its_oldest_attempts_first(tmp_path: Path) -> None:
    async with DeliveryLog(tmp_path / "ingest.sqlite", vhost="t", retention_s=86400, max_bytes=10**9) as log:
        await fill(log, 20_000)
        full = await log.used_bytes()
        assert await log.expire(now_s=NOW_S) == 0  # within the budget and the retention: nothing goes
        log.max_bytes = full // 2
        removed = await log.expire(now_s=NOW_S)
        assert removed > 0
        assert await log.used_bytes() <= full // 2
        kept = await log.attempts_of_endpoint(
            "ep_" + "0" * 26, outcome=None, since_s=None, before_id=None, limit=10**6
        )
        assert len(kept) < 20_000
        newest = {record.event_id for _, record in kept}
        assert f"evt_{19_999:026d}" in newest  # the newest stay...
        assert f"evt_{0:026d}" not in newest  # ...the oldest went
        assert await log.expire(now_s=NOW_S) == 0  # the headroom: no trim at every pass


async def test_retention_still_applies_under_the_budget(tmp_path: Path) -> None:
    async with DeliveryLog(tmp_path / "ingest.sqlite", vhost="t", retention_s=3000, max_bytes=10**9) as log:
        await fill(log, 1_000)
        assert await log.expire(now_s=NOW_S) > 0
        kept = await log.attempts_of_endpoint(
            "ep_" + "0" * 26, outcome=None, since_s=None, before_id=None, limit=10**6
        )
        assert kept
        assert all(record.at_s >= NOW_S - 3000 for _, record in kept)
        assert len(kept) == 400  # those at most 3,000 s old: the last 400 of 1,000, one a second
