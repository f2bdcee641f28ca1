"""Records that must reach the broker even when it refuses them now: the monitor's alerts and tenant
notifications, the ingest's own attempts and their audit records. During a memory or disk alarm (or a
lost connection) a publish fails at once; what failed is held here, in order, and published once the
broker takes publishes again, instead of being dropped.

Held in memory and bounded: past ``max_held`` the oldest record is dropped (``held_publish_dropped``,
``hookline_held_publishes_dropped_total``), since a record that has waited that long matters less than
the ones after it, and a broker that refuses publishes must not take a service's memory with it. A
service stopped while records are held loses them (:meth:`HeldPublishes.close` says how many).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable
from dataclasses import dataclass

import aio_pika
import aiormq
import prometheus_client
import structlog

from hookline.shared.broker.amqp import BROKER_ERRORS, Broker, Publisher
from hookline.shared.runtime.supervision import Loop

log = structlog.get_logger(__name__)

HELD = prometheus_client.Gauge(
    "hookline_held_publishes",
    "Records the broker refused (an alarm), held to be published once it takes them.",
)
DROPPED = prometheus_client.Counter(
    "hookline_held_publishes_dropped", "Held records dropped because more than the bound were held."
)
#: How often a held record is tried again while the broker takes publishes (it failed for another reason).
RETRY_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class _Held:
    message: aio_pika.Message
    exchange: str
    routing_key: str
    what: str  # for the log line should it be dropped


class HeldPublishes:
    """Publishes through ``publisher`` in order; what the broker refuses waits for :meth:`flush` (called
    by the owner's own loop, or by :meth:`run` as a supervised loop of its own)."""

    def __init__(
        self,
        publisher: Publisher,
        *,
        max_held: int,
        held: Iterable[tuple[aio_pika.Message, str, str]] = (),
    ) -> None:
        """``held``: (message, exchange, routing key) still to publish, as :meth:`items` gave them to be
        saved (the monitor keeps its alert book's on disk)."""
        self._publisher = publisher
        self._held: collections.deque[_Held] = collections.deque(
            _Held(message, exchange, routing_key, message.type or "restored")
            for message, exchange, routing_key in held
        )
        self._max_held = max_held
        self._flushing = asyncio.Lock()  # two flushes at once would publish the head twice
        HELD.set_function(lambda: len(self._held))

    def __len__(self) -> int:
        return len(self._held)

    def items(self) -> list[tuple[aio_pika.Message, str, str]]:
        """What is held, in order: (message, exchange, routing key)."""
        return [(held.message, held.exchange, held.routing_key) for held in self._held]

    def hold(self, message: aio_pika.Message, *, exchange: str, routing_key: str, what: str) -> None:
        """Queue ``message`` behind those already held (published at the next flush)."""
        self._held.append(_Held(message, exchange, routing_key, what))
        while len(self._held) > self._max_held:
            dropped = self._held.popleft()
            DROPPED.inc()
            log.error("held_publish_dropped", what=dropped.what, held=len(self._held), alert=True)

    async def publish(self, message: aio_pika.Message, *, exchange: str, routing_key: str, what: str) -> bool:
        """Publish now, after whatever is held; False when it is held for later."""
        self.hold(message, exchange=exchange, routing_key=routing_key, what=what)
        await self.flush()
        return not any(held.message is message for held in self._held)

    async def flush(self) -> None:
        """In order, until the broker refuses one: the rest wait for the next flush."""
        async with self._flushing:
            while self._held:
                head = self._held[0]
                try:
                    await self._publisher.publish(
                        head.message, exchange=head.exchange, routing_key=head.routing_key
                    )
                except aiormq.exceptions.DeliveryError:
                    # Nowhere to go (a notifier's queue deleted with it): waiting would hold up the rest.
                    log.warning(
                        "unroutable", exchange=head.exchange, routing_key=head.routing_key, what=head.what
                    )
                except BROKER_ERRORS:
                    return
                if self._held and self._held[0] is head:  # not dropped meanwhile by a hold past the bound
                    self._held.popleft()

    async def run(self, broker: Broker, loop: Loop) -> None:
        """A loop of its own: flush whenever the broker takes publishes and something is held."""
        loop.mark_up()
        while True:
            if self._held:
                await broker.unblocked()
                await self.flush()
            loop.beat()
            await asyncio.sleep(RETRY_INTERVAL_S)

    async def close(self) -> None:
        """One last try; what is still held then is lost with the process, and said so."""
        await self.flush()
        if self._held:
            log.error("held_publishes_lost", count=len(self._held), alert=True)
