"""Acknowledgements in batches: one ``basic.ack multiple`` for a run of settled deliveries.

A quorum queue turns every ack into a command in its Raft log, so one ack for a run of messages costs the
broker (and this process) a fraction of one ack each; on a 2-core machine the broker's share is what
limits throughput. An ack is still sent only after its message's outcome is recorded (the handler calls
:meth:`Acks.ack` where it used to ack), only later by at most a few milliseconds: a crash in between
redelivers the message, which at-least-once allows.

Delivery tags are per channel, one more for each delivery, and ``multiple`` covers every tag up to the
one given that is still unacked at the broker. So a ``multiple`` ack only ever ends a run of consecutive
tags starting right after the last one it covered, each one seen here and settled: acked, or handed back
with its nack or reject already written. Anything else is never covered: a delivery in flight, a nack
still waiting for room in the connection's write queue (aiormq's holds ten frames, and a writer waiting
for room can be overtaken by a later one: an ack covering that tag would get there first, the message
would be acked instead of handed back, and the nack would close the channel on an unknown tag), and a tag
this process never saw. Settled deliveries behind one of those are acked one by one after ``ACK_HOLD_S``,
so a slow endpoint never holds another endpoint's prefetch window for long. A delivery whose handling
ended without settling it (cancelled at shutdown) stays outstanding until its channel closes: it is
still unacked at the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiormq
from aio_pika.exceptions import ChannelInvalidStateError

from hookline.dispatcher.consumed import Delivery, Incoming
from hookline.shared.broker.amqp import BROKER_ERRORS

#: How long settled acks wait for more to join them: one round of the event loop is often enough.
ACK_BATCH_S = 0.002
#: A settled delivery behind one still in flight waits at most this long before it is acked alone.
ACK_HOLD_S = 0.02


class _Window:
    """The deliveries of one channel not yet covered by a ``multiple`` ack."""

    __slots__ = ("acked_through", "alone", "channel", "flushing", "outstanding")

    def __init__(self, channel: aiormq.abc.AbstractChannel) -> None:
        self.channel = channel
        # Seen, not settled alone: tag -> when it was acked here (None: in flight, or its nack or
        # reject is not written yet). In delivery (tag) order.
        self.outstanding: dict[int, float | None] = {}
        self.alone: set[int] = set()  # seen and settled one by one, the frame written
        self.acked_through = 0  # every tag up to this one is settled and its frame written
        self.flushing = False

    def run_end(self) -> int | None:
        """The last acked tag of the settled run right after ``acked_through``; the run is forgotten."""
        outstanding, alone = self.outstanding, self.alone
        through, run_end = self.acked_through, None
        for tag, settled in outstanding.items():
            while through + 1 < tag and through + 1 in alone:
                through += 1
                alone.discard(through)
            if settled is None or tag != through + 1:
                break  # in flight, or a tag never seen here
            through = run_end = tag
        while through + 1 in alone:
            through += 1
            alone.discard(through)
        if run_end is not None:
            for tag in [tag for tag in outstanding if tag <= run_end]:
                del outstanding[tag]
        self.acked_through = through
        return run_end


class Acks:
    def __init__(self, *, batch_s: float = ACK_BATCH_S, hold_s: float = ACK_HOLD_S) -> None:
        self._batch_s = batch_s
        self._hold_s = hold_s
        self._windows: dict[int, _Window] = {}  # id(aiormq channel) ->
        self._flushes: set[asyncio.Task[None]] = set()

    def delivered(self, message: Incoming) -> None:
        """A message consumed from a queue: its ack may be batched from now on."""
        tag = message.delivery_tag
        if tag is None or not isinstance(message, Delivery):
            return  # a probe's basic.get: acked at once
        channel = message.channel
        window = self._windows.get(id(channel))
        if window is None or window.channel is not channel:
            window = self._windows[id(channel)] = _Window(channel)
        window.outstanding[tag] = None

    async def ack(self, message: Incoming) -> None:
        window = self._window(message)
        if (
            window is None
            or not isinstance(message, Delivery)
            or message.delivery_tag not in window.outstanding
        ):
            await message.ack()  # not consumed (a basic.get probe), or its channel is gone
            return
        # Settled for the message too (a second ack, nack or reject raises), never sent alone.
        window.outstanding[message.settle()] = time.monotonic()
        if not window.flushing:
            window.flushing = True
            flush = asyncio.create_task(self._flush_soon(window))
            self._flushes.add(flush)
            flush.add_done_callback(self._flushes.discard)

    async def nack(self, message: Incoming, *, requeue: bool) -> None:
        window = self._in_flight(message)
        await message.nack(requeue=requeue)
        if window is not None:
            self._settled_alone(window, message.delivery_tag)

    async def reject(self, message: Incoming, *, requeue: bool) -> None:
        window = self._in_flight(message)
        await message.reject(requeue=requeue)
        if window is not None:
            self._settled_alone(window, message.delivery_tag)

    def pending(self) -> int:
        """Settled deliveries whose ack is not sent yet."""
        return sum(
            settled is not None
            for window in self._windows.values()
            for settled in window.outstanding.values()
        )

    async def flush(self) -> None:
        """Send every settled ack now (shutdown, before the channels close)."""
        for window in list(self._windows.values()):
            await self._send(window, hold_s=0.0)

    def forget_closed(self) -> None:
        """Drop the windows of closed channels: their unacked deliveries are back in their queues."""
        for key, window in list(self._windows.items()):
            if window.channel.is_closed:
                del self._windows[key]

    def _window(self, message: Incoming) -> _Window | None:
        try:
            channel = message.channel
        except ChannelInvalidStateError:
            return None  # closed: the caller's ack or nack fails as it would have without batching
        window = self._windows.get(id(channel))
        return window if window is not None and window.channel is channel else None

    def _in_flight(self, message: Incoming) -> _Window | None:
        """The window holding ``message`` in flight: it stays there, uncovered, until its frame is written."""
        window = self._window(message)
        tag = message.delivery_tag
        in_flight = window is not None and tag is not None and window.outstanding.get(tag, 0) is None
        return window if in_flight else None

    @staticmethod
    def _settled_alone(window: _Window, tag: int | None) -> None:
        if tag is not None and window.outstanding.pop(tag, 0) is None:
            window.alone.add(tag)

    async def _flush_soon(self, window: _Window) -> None:
        try:
            while True:
                await asyncio.sleep(self._batch_s)
                await self._send(window, hold_s=self._hold_s)
                if not any(settled is not None for settled in window.outstanding.values()):
                    return
        finally:
            window.flushing = False

    async def _send(self, window: _Window, *, hold_s: float) -> None:
        run_end = window.run_end()
        now_s = time.monotonic()
        alone = [
            tag
            for tag, settled in window.outstanding.items()
            if settled is not None and now_s - settled >= hold_s
        ]
        for tag in alone:
            del window.outstanding[tag]
        if window.channel.is_closed:
            return  # nothing to ack on a closed channel: its deliveries are redelivered
        with contextlib.suppress(*BROKER_ERRORS):
            if run_end is not None:
                await window.channel.basic_ack(run_end, multiple=True)
            for tag in alone:
                await window.channel.basic_ack(tag)
                window.alone.add(tag)
