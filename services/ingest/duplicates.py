"""Idempotent ingest: an event accepted once is not published again when its request is retried.

An event is the same event when its tenant and id are: an upstream's own id, or one derived from its
``Idempotency-Key`` (so a retry of a keyed request gets the same id on any replica). Within
``HOOKLINE_DEDUPE_WINDOW_S`` the second one publishes nothing and is answered 200 ``duplicate``.

Where an acceptance is found: the delivery log's events (durable, fed by the event log stream, so
they hold what every replica and every AMQP publisher sent, and survive restarts), and, for the
moment between a confirm and that stream reaching this replica's log, what this replica accepted in
the last ``RECENT_S``. A publish the broker nacked may still have left a copy in the event log
stream (and so in the log) while a lane's queue never got it: a retry of an event whose publish failed
on this replica is published again, never answered as a duplicate of that copy (a retry that reaches
another replica still is: see the README's "Idempotent ingest"). Requests for one event wait for each
other here. Two requests for one event
at two replicas within milliseconds may both be accepted; they carry the same id, so receivers,
which deduplicate by ``webhook-id``, see it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeAlias

from hookline.ingest.deliverylog import Acceptance, DeliveryLog
from hookline.ingest.schemas import EventIn
from hookline.shared.contracts.ids import derived_id

#: How long this replica remembers its own acceptances: far longer than its log takes to see them.
RECENT_S = 30.0
IDEMPOTENCY_KEY_MAX = 255

_Key: TypeAlias = tuple[str, str]  # (tenant, event id)


def event_id_for_key(tenant: str, key: str) -> str:
    """The event id a request with this ``Idempotency-Key`` gets: the same on every replica."""
    return derived_id("evt", f"{tenant}\0{key}")


def request_digest(event: EventIn) -> str:
    """What a keyed request asked for (everything but the id it may carry), to refuse the key reused."""
    content = event.model_dump(mode="json", exclude={"id"})
    # The standard library's encoder: integers of any size, and lone surrogates escaped.
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


@dataclass
class Claim:
    previous: Acceptance | None  # an earlier acceptance within the window: this one is a duplicate
    accepted: Acceptance | None = None  # set once the broker confirmed this one


class Duplicates:
    def __init__(self, log: DeliveryLog, *, window_s: float) -> None:
        self._log = log
        self._window_s = window_s
        self._recent: dict[_Key, Acceptance] = {}  # in acceptance order
        # Events whose publish here was not confirmed (a nack, a timeout): when -> the log may hold the
        # copy a nacked publish left in the event log stream while a lane never got it, and that copy
        # must not make the retry a duplicate.
        self._unconfirmed: dict[_Key, float] = {}
        self._locks: dict[_Key, asyncio.Lock] = {}
        self._waiting: Counter[_Key] = Counter()

    @contextlib.asynccontextmanager
    async def claim(self, tenant: str, event_id: str) -> AsyncIterator[Claim]:
        """Hold the event against concurrent requests for it; say whether it was accepted already."""
        if self._window_s <= 0:
            yield Claim(previous=None)
            return
        key = (tenant, event_id)
        lock = self._locks.setdefault(key, asyncio.Lock())
        self._waiting[key] += 1
        try:
            async with lock:
                claim = Claim(previous=await self._previous(key))
                try:
                    yield claim
                except BaseException:
                    if claim.previous is None:
                        self._unconfirmed[key] = time.time()
                    raise
                if claim.accepted is not None:
                    self._recent[key] = claim.accepted
                    self._unconfirmed.pop(key, None)
        finally:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key], self._locks[key]

    async def _previous(self, key: _Key) -> Acceptance | None:
        now_s = time.time()
        self._forget_older_than(now_s - RECENT_S)
        recent = self._recent.get(key)
        if recent is not None:
            return recent
        for stale in [k for k, at_s in self._unconfirmed.items() if at_s < now_s - self._window_s]:
            del self._unconfirmed[stale]
        if key in self._unconfirmed:
            return None  # its last publish here failed: whatever the log saw of it, publish it again
        tenant, event_id = key
        return await self._log.accepted(tenant, event_id, since_s=now_s - self._window_s)

    def _forget_older_than(self, since_s: float) -> None:
        recent = self._recent
        while recent:
            oldest = next(iter(recent))
            if recent[oldest].accepted_at_s >= since_s:
                return
            del recent[oldest]
