"""Idempotent ingest (ingest/duplicates.py): a publish that failed never makes its retry a duplicate."""

from __future__ import annotations

import time

import pytest

from hookline.ingest.deliverylog import Acceptance
from hookline.ingest.duplicates import Duplicates


class EventLogView:
    """What the delivery log answers for an event whose nacked publish still reached the event log
    stream (the cluster test's case: the stream took it, a lane whose leader had just died did not)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str], Acceptance] = {}

    async def accepted(self, tenant: str, event_id: str, *, since_s: float) -> Acceptance | None:
        found = self.seen.get((tenant, event_id))
        return found if found is not None and found.accepted_at_s >= since_s else None


class NackedError(Exception):
    pass


async def publish_nacked(duplicates: Duplicates, log: EventLogView, key: tuple[str, str]) -> None:
    async with duplicates.claim(*key) as claim:
        assert claim.previous is None
        log.seen[key] = Acceptance(type="t", accepted_at_s=time.time(), request_digest=None)
        raise NackedError  # the broker nacked the publish (503 to the caller)


async def test_a_retry_after_a_failed_publish_is_published_again_even_if_the_log_saw_it() -> None:
    log = EventLogView()
    duplicates = Duplicates(log, window_s=3600)  # type: ignore[arg-type]
    with pytest.raises(NackedError):
        await publish_nacked(duplicates, log, ("acme", "evt_1"))
    async with duplicates.claim("acme", "evt_1") as retry:
        assert retry.previous is None, "published again, not answered as a duplicate"
        retry.accepted = Acceptance(type="t", accepted_at_s=time.time(), request_digest=None)
    async with duplicates.claim("acme", "evt_1") as again:
        assert again.previous is not None, "once confirmed, a retry is a duplicate again"


async def test_an_event_the_log_saw_and_this_replica_never_failed_is_a_duplicate() -> None:
    log = EventLogView()
    log.seen[("acme", "evt_2")] = Acceptance(type="t", accepted_at_s=time.time(), request_digest=None)
    duplicates = Duplicates(log, window_s=3600)  # type: ignore[arg-type]
    async with duplicates.claim("acme", "evt_2") as claim:
        assert claim.previous is not None
