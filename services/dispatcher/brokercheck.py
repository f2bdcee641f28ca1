"""The check with the broker: the safety net under its cancel. Each queue this replica consumes (lanes,
queues of their own) is asked how many consumers it has (a passive declare), at most CHECKS_PER_S a
second; one the broker finds gone, or with no consumer, is let go of and attached again (provisioned,
if it is a current queue), as a cancel would have done.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from hookline.dispatcher import consumed, metrics
from hookline.dispatcher.changes import LANES, Changes
from hookline.dispatcher.laneconsumers import LaneConsumers
from hookline.dispatcher.ownqueues import Mode, OwnQueues
from hookline.shared.broker.amqp import BROKER_ERRORS, CALL_TIMEOUT_S, QueueProbe
from hookline.shared.runtime.supervision import Loop

log = structlog.get_logger(__name__)

#: Queues asked about per second when checking the consumers with the broker (passive declares).
CHECKS_PER_S = 50


class BrokerCheck:
    def __init__(
        self, lanes: LaneConsumers, own_queues: OwnQueues, checks: QueueProbe, changes: Changes
    ) -> None:
        self._lanes = lanes
        self._own_queues = own_queues
        self._checks = checks  # the check with the broker's, apart from the attaching's
        self._changes = changes

    async def run(self, *, every_s: float) -> None:
        """The safety net under the broker's cancel: each queue this replica consumes is asked how many
        consumers it has (a passive declare), at most CHECKS_PER_S a second and each at least every
        ``every_s``; one the broker finds gone, or with no consumer, is attached again (and provisioned,
        if it is a current queue), as a cancel would have done."""
        started_s = time.monotonic()
        for name, (tag, lane_channel) in list(self._lanes.consumed.items()):
            queue = await self._checks.find(name)
            if self._lanes.consumed.get(name, (None, None))[0] != tag:
                continue
            if queue is None or not queue.declaration_result.consumer_count:
                log.error(
                    "consumer_missing_at_broker",
                    queue=name,
                    tag=tag,
                    queue_exists=queue is not None,
                    alert=True,
                )
                metrics.CONSUMERS_REATTACHED.inc()
                del self._lanes.consumed[name]
                with contextlib.suppress(*BROKER_ERRORS):
                    await consumed.cancel(lane_channel, tag, timeout_s=CALL_TIMEOUT_S)
                self._changes.put(LANES)
            await asyncio.sleep(1 / CHECKS_PER_S)
        for name, consumer in self._own_queues.active.items():
            queue = await self._checks.find(name)
            current = self._own_queues.active.get(name)
            if current is not consumer:
                continue  # changed meanwhile: the reconcile that did it has looked
            if queue is None or not queue.declaration_result.consumer_count:
                # A queue only drained (left behind, or a deleted endpoint's) is removed once empty.
                if queue is not None or consumer.wanted.mode is Mode.DELIVER:
                    log.error(
                        "consumer_missing_at_broker",
                        queue=name, endpoint_id=consumer.wanted.endpoint_id, tag=consumer.tag,
                        queue_exists=queue is not None, alert=True,
                    )  # fmt: skip
                    metrics.CONSUMERS_REATTACHED.inc()
                self._own_queues.active.pop(name)
                with contextlib.suppress(*BROKER_ERRORS):
                    await consumed.cancel(consumer.channel, consumer.tag, timeout_s=CALL_TIMEOUT_S)
                self._changes.put(consumer.wanted.endpoint_id)
            await asyncio.sleep(1 / CHECKS_PER_S)
        await asyncio.sleep(max(0.0, started_s + every_s - time.monotonic()))


async def check_consumers(check: BrokerCheck, every_s: float, loop: Loop) -> None:
    loop.mark_up()
    while True:
        await check.run(every_s=every_s)
        loop.beat()
