"""Messages that are not delivered where they are: in a queue the endpoint has left (forwarded to its
address), addressed to a queue that was not there (forwarded to the endpoint's address as it is now, or
dead-lettered), and the fence an ingest put in an endpoint's lane (:mod:`.fences`).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from functools import partial

import structlog

from hookline.dispatcher import fences
from hookline.dispatcher.acks import Acks
from hookline.dispatcher.consumed import Incoming
from hookline.dispatcher.settings import DispatcherSettings
from hookline.dispatcher.settling import Settling, carried_headers
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Publisher
from hookline.shared.broker.isolation import Isolation
from hookline.shared.contracts import addressing
from hookline.shared.contracts.headers import Header
from hookline.shared.contracts.models import DeadLetterReason
from hookline.shared.state.registry import ChangeLog

log = structlog.get_logger(__name__)

#: A copy forwarded this many times without reaching a queue (it keeps coming back unroutable) is kept
#: as an ``unroutable`` dead letter instead.
MAX_FORWARDS = 3


class Forwarding:
    def __init__(
        self,
        settings: DispatcherSettings,
        change_log: ChangeLog,
        publisher: Publisher,
        acks: Acks,
        settling: Settling,
        isolation: Isolation | None,
    ) -> None:
        self._settings = settings
        self._registry = change_log.registry
        self._change_log = change_log
        self._publisher = publisher
        self._acks = acks
        self._settling = settling
        self._isolation = isolation

    async def forward(self, endpoint_id: str, message: Incoming) -> None:
        """A message in a queue the endpoint has left (a queue of an earlier generation, or of the
        version before lanes): to its address (confirmed), then acked."""
        endpoint = self._registry.get(endpoint_id)
        if endpoint is None:
            await self._settling.gone(endpoint_id, message)
            return
        await self._settling.hand_on(message, endpoint, reason="forwarded")

    async def handle_unroutable(self, message: Incoming) -> None:
        """A message addressed to a queue that was not there (removed once drained, or deleted by hand):
        forwarded to the endpoint's address as it is now, or dead-lettered when the endpoint is gone or
        the message keeps coming back."""
        destination = topology.delay_destination(message.routing_key or "")
        endpoint_id = addressing.endpoint_named(message.headers) or topology.endpoint_of(destination)
        endpoint = self._registry.get(endpoint_id) if endpoint_id else None
        if endpoint is None:
            await self._settling.gone(endpoint_id or destination, message)
            return
        forwards = (message.headers or {}).get(Header.FORWARDS, 0)
        forwards = forwards if isinstance(forwards, int) else MAX_FORWARDS
        if forwards >= MAX_FORWARDS:
            await self._settling.dead_letter(
                message, endpoint.id, endpoint.tenant, DeadLetterReason.UNROUTABLE,
                event_id=message.message_id, attempts=0, last_status=None,
                last_error=f"nothing bound for {destination} to take it, {forwards} times",
            )  # fmt: skip
            await self._acks.ack(message)
            return
        if (
            self._registry.placements.isolated(endpoint)
            and not self._registry.placements.held(endpoint)
            and self._isolation
        ):
            # Deleted by hand, or lost with a node: declared again once its consumers have been told.
            await asyncio.sleep(topology.REDECLARE_AFTER_S)
            await self._isolation.ensure_queue(endpoint)
        copy = addressing.message(
            message.body,
            event_id=message.message_id or "",
            endpoint_id=endpoint.id,
            content_type=message.content_type,
            timestamp=message.timestamp,
            headers={**carried_headers(message), Header.FORWARDS: forwards + 1},
        )
        await addressing.send(self._publisher, copy, destination=self._registry.placements.address(endpoint))
        await self._acks.ack(message)
        log.info(
            "message_forwarded", endpoint_id=endpoint.id, event_id=message.message_id, missing=destination
        )

    async def fence(self, message: Incoming, endpoint_id: str) -> None:
        """A fence an ingest put in an endpoint's lane has come out of it (:mod:`.fences`): every lane
        message published before the endpoint's deletion, or before its queue of its own was bound to
        ``events``, has been given out; the fan-out stops counting it. Taken before this replica knows
        of the change (it follows the change log a moment behind): put back in its lane for a second,
        never in the endpoint's queue of its own (a deleted one's is drained into dead letters once the
        deletion is known, so the fence would never pass and the fan-out count the endpoint for ever)."""
        endpoint = self._registry.get(endpoint_id)
        fence_id = message.message_id
        version = (message.headers or {}).get(Header.FENCE_VERSION)
        verdict = fences.verdict(
            endpoint,
            deleting=self._registry.deletions.deleting(endpoint_id),
            fence_id=fence_id,
            fence_version=version if isinstance(version, int) else None,
        )
        if verdict is fences.Verdict.DRAINED:
            await self._change_log.drained(endpoint_id, timeout_s=self._settings.connect_timeout_s)
        elif verdict is fences.Verdict.LEFT:
            await self._change_log.update(
                endpoint_id,
                partial(fences.left, fence_id=fence_id, at=datetime.now(UTC)),
                timeout_s=self._settings.connect_timeout_s,
            )
        elif verdict is fences.Verdict.EARLY:
            assert endpoint is not None
            lane = topology.lane_of(endpoint.tenant)
            await self._settling.hand_on(message, endpoint, delay_s=1, reason="fence_early", destination=lane)
            return
        log.info("endpoint_fence_passed", endpoint_id=endpoint_id, verdict=verdict.value)
        await self._acks.ack(message)
