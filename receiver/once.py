"""Verify, then run the handler once per ``webhook-id``: hookline delivers at least once (retries,
redeliveries after a crash, resends by an operator), the same ``webhook-id`` each time.

The id is recorded only after the handler returned: a handler that raises leaves it unrecorded, so
hookline's retry (the request answered 5xx) runs it again.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from hookline.receiver.stores import AsyncSeenStore, Clock, MemoryStore, SeenStore, Status, as_async, is_async
from hookline.receiver.verify import DEFAULT_TOLERANCE_S, Delivery, Secrets, signing_keys, verify

log = logging.getLogger("hookline.receiver")

T = TypeVar("T")


class Outcome(enum.Enum):
    HANDLED = "handled"  # the handler ran now and returned
    DUPLICATE = "duplicate"  # handled before: not run again
    IN_PROGRESS = "in_progress"  # another request is handling it now; hookline should come back later


@dataclass(frozen=True, slots=True)
class Handled(Generic[T]):
    outcome: Outcome
    delivery: Delivery
    result: T | None = None  # what the handler returned, when it ran


class _Verifier:
    def __init__(self, secrets: Secrets, *, tolerance_s: float, clock: Clock) -> None:
        self._secrets = [secrets] if isinstance(secrets, str) else list(secrets)
        signing_keys(self._secrets)  # a malformed secret fails here, at start
        self.tolerance_s = tolerance_s
        self._clock = clock

    def verify(self, headers: Mapping[str, str], body: bytes) -> Delivery:
        """The verified delivery, or a VerificationError."""
        return verify(headers, body, self._secrets, now_s=self._clock(), tolerance_s=self.tolerance_s)


class Receiver(_Verifier):
    """For synchronous code (Flask, Django, a worker). ``secrets``: one ``whsec_`` secret, or several
    while rotating. ``store``: where handled ids are kept (default: this process's memory)."""

    def __init__(
        self,
        secrets: Secrets,
        store: SeenStore | None = None,
        *,
        tolerance_s: float = DEFAULT_TOLERANCE_S,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(secrets, tolerance_s=tolerance_s, clock=clock)
        self.store: SeenStore = MemoryStore() if store is None else store
        if is_async(self.store):
            raise TypeError("this store is asynchronous: use AsyncReceiver")

    def once(self, delivery: Delivery, handler: Callable[[Delivery], T]) -> Handled[T]:
        claim = self.store.claim(delivery.webhook_id)
        if claim.status is not Status.CLAIMED:
            return _not_run(delivery, claim.status)
        try:
            result = handler(delivery)
        except BaseException:
            self.store.release(claim)
            raise
        self.store.complete(claim)
        return Handled(Outcome.HANDLED, delivery, result)

    def handle(self, headers: Mapping[str, str], body: bytes, handler: Callable[[Delivery], T]) -> Handled[T]:
        return self.once(self.verify(headers, body), handler)


class AsyncReceiver(_Verifier):
    """For asyncio code (FastAPI, Starlette, aiohttp). A synchronous store is called in a worker thread."""

    def __init__(
        self,
        secrets: Secrets,
        store: SeenStore | AsyncSeenStore | None = None,
        *,
        tolerance_s: float = DEFAULT_TOLERANCE_S,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(secrets, tolerance_s=tolerance_s, clock=clock)
        self.store = as_async(MemoryStore() if store is None else store)

    async def once(self, delivery: Delivery, handler: Callable[[Delivery], Awaitable[T]]) -> Handled[T]:
        claim = await self.store.claim(delivery.webhook_id)
        if claim.status is not Status.CLAIMED:
            return _not_run(delivery, claim.status)
        try:
            result = await handler(delivery)
        except BaseException:
            # Cancelled too: the work did not finish, so the id must stay open for the retry.
            await self.store.release(claim)
            raise
        await self.store.complete(claim)
        return Handled(Outcome.HANDLED, delivery, result)

    async def handle(
        self, headers: Mapping[str, str], body: bytes, handler: Callable[[Delivery], Awaitable[T]]
    ) -> Handled[T]:
        return await self.once(self.verify(headers, body), handler)


def _not_run(delivery: Delivery, status: Status) -> Handled[T]:
    outcome = Outcome.DUPLICATE if status is Status.DONE else Outcome.IN_PROGRESS
    log.info("webhook not handled again: %s (webhook-id %s)", outcome.value, delivery.webhook_id)
    return Handled(outcome, delivery)
