"""Acknowledgements in batches: one ``basic.ack multiple`` for a run of settled deliveries.

A quorum queue turns every ack into a command in its Raft log, so one ack for a run of messages costs the
broker (and this process) a fraction of one ack each; on a 2-core machine the broker's share is what
limits throughput. An ack is still sent only after its message's outcome is recorded (the handler calls
:meth:`Acks.ack` where it used to ack), only later by at most a few milliseconds: a crash in between
redelivers the message, which at-least-once allows.

Delivery tags are per channel and ``multiple`` covers every tag up to the one given, so only a run that
starts at the oldest outstanding delivery of a channel is acked that way; a delivery still in flight is
never covered. Settled deliveries behind one still in flight are acked one by one after
``ACK_HOLD_S``, so a slow endpoint never holds another endpoint's prefetch window for long. A delivery
whose handling ended without settling it (cancelled at shutdown) stays outstanding until its channel
closes: it is still unacked at the broker, and ``multiple`` must never cover it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiormq
from aio_pika.exceptions import ChannelInvalidStateError

from hookline.dispatcher.incoming import Delivery, Incoming
from hookline.shared.amqp import BROKER_ERRORS

#: How long settled acks wait for more to join them: one round of the event loop is often enough.
ACK_BATCH_S = 0.002
#: A settled delivery behind one still in flight waits at most this long before it is acked alone.
ACK_HOLD_S = 0.02


class _Window:
    """The deliveries of one channel not yet acked: tag → when it was settled (None: in flight)."""

    __slots__ = ("channel", "flushing", "outstanding")

    def __init__(self, channel: aiormq.abc.AbstractChannel) -> None:
        self.channel = channel
        self.outstanding: dict[int, float | None] = {}  # in delivery (tag) order
        self.flushing = False


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
        self._forget(message)
        await message.nack(requeue=requeue)

    async def reject(self, message: Incoming, *, requeue: bool) -> None:
        self._forget(message)
        await message.reject(requeue=requeue)

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

    def _forget(self, message: Incoming) -> None:
        window = self._window(message)
        tag = message.delivery_tag
        if window is not None and tag is not None and window.outstanding.get(tag, 0) is None:
            del window.outstanding[tag]

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
        outstanding = window.outstanding
        run_end: int | None = None
        for tag, settled in outstanding.items():
            if settled is None:
                break
            run_end = tag
        now_s = time.monotonic()
        alone = [
            tag
            for tag, settled in outstanding.items()
            if settled is not None and (run_end is None or tag > run_end) and now_s - settled >= hold_s
        ]
        if run_end is not None:
            for tag in [tag for tag in outstanding if tag <= run_end]:
                del outstanding[tag]
        for tag in alone:
            del outstanding[tag]
        if window.channel.is_closed:
            return  # nothing to ack on a closed channel: its deliveries are redelivered
        with contextlib.suppress(*BROKER_ERRORS):
            if run_end is not None:
                await window.channel.basic_ack(run_end, multiple=True)
            for tag in alone:
                await window.channel.basic_ack(tag)
