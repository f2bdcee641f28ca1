"""The breakers as this replica acts on them: the half-open probe the monitor names it for (one message
taken with ``basic.get`` from the endpoint's queue of its own, or a held endpoint's next copy from its
holding lane), the probes it reports in its heartbeats, and breakers whose lease ran out, closed here.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial

import structlog

from hookline.dispatcher import metrics
from hookline.dispatcher.changes import RECONCILE_RETRY_S, Changes
from hookline.dispatcher.consumed import Incoming
from hookline.dispatcher.handler import Handler, handle_safely
from hookline.dispatcher.handling import Handling
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import BROKER_ERRORS, CALL_TIMEOUT_S, Broker
from hookline.shared.contracts.control import BreakerState, BreakerView
from hookline.shared.contracts.models import EndpointStatus, StoredEndpoint
from hookline.shared.runtime.supervision import Loop
from hookline.shared.state.registry import EndpointRegistry

log = structlog.get_logger(__name__)

PROBE_POLL_S = 1.0


class Probes:
    def __init__(
        self,
        broker: Broker,
        registry: EndpointRegistry,
        breakers: BreakerView,
        handler: Handler,
        dispatcher_id: str,
        handling: Handling,
        changes: Changes,
    ) -> None:
        self._broker = broker
        self._registry = registry
        self._breakers = breakers
        self._handler = handler
        self._dispatcher_id = dispatcher_id
        self._handling = handling
        self._changes = changes
        self._probes: dict[str, int] = {}  # endpoint id -> the half-open version being probed

    def probing(self) -> dict[str, int]:
        """The half-open breakers whose probe this replica has taken on (for heartbeats)."""
        probing = {}
        for endpoint_id, version in list(self._probes.items()):
            breaker = self._breakers.state(endpoint_id)
            if breaker is not None and breaker.state is BreakerState.HALF_OPEN and breaker.version == version:
                probing[endpoint_id] = version
            else:
                del self._probes[endpoint_id]  # decided: closed, or open again with a new version
        return probing

    async def held(self, endpoint_id: str, message: Incoming) -> None:
        """A held endpoint's copy; while its breaker is half open, the first to come to the replica the
        monitor named is its probe (a held endpoint has no queue to take one from with ``basic.get``)."""
        breaker = self._breakers.state(endpoint_id)
        probe = (
            breaker is not None
            and breaker.state is BreakerState.HALF_OPEN
            and breaker.probe_by == self._dispatcher_id
            and self._probes.get(endpoint_id) != breaker.version
        )
        if probe:
            assert breaker is not None
            self._probes[endpoint_id] = breaker.version
            log.info("breaker_probe", endpoint_id=endpoint_id, version=breaker.version, held=True)
        attempted = await handle_safely(self._handler, endpoint_id, message, probe=probe, held=True)
        if probe and not attempted:
            self._probes.pop(endpoint_id, None)  # no attempt came of it: probe with the next one

    def maybe_probe(self, endpoint_id: str) -> None:
        endpoint = self._registry.get(endpoint_id)
        breaker = self._breakers.state(endpoint_id)
        if (
            endpoint is not None
            and self._registry.placements.has_queue(
                endpoint_id
            )  # a held one's probe comes from its holding lane
            and endpoint.status is EndpointStatus.ACTIVE
            and endpoint.verified
            and breaker is not None
            and breaker.state is BreakerState.HALF_OPEN
            and breaker.probe_by == self._dispatcher_id
            and self._probes.get(endpoint_id) != breaker.version
        ):
            self._probes[endpoint_id] = breaker.version
            probe = asyncio.create_task(self._probe(endpoint, breaker.version), name=f"probe:{endpoint_id}")
            self._handling.add(probe)
            probe.add_done_callback(partial(self._probe_ended, endpoint_id))

    def _probe_ended(self, endpoint_id: str, probe: asyncio.Task[None]) -> None:
        """A probe that ended on an error its loop does not expect (or was cancelled from under it, as a
        channel's pending call is when its connection goes) is started again: the breaker's version is
        still marked as probed, and nothing else would ever probe it, leaving it half open for good."""
        self._handling.discard(probe)
        if self._changes.stopping or not (probe.cancelled() or probe.exception() is not None):
            return
        error = "cancelled" if probe.cancelled() else type(probe.exception()).__name__
        log.error("breaker_probe_crashed", endpoint_id=endpoint_id, error=error, alert=True)
        self._probes.pop(endpoint_id, None)
        self._changes.put_later(RECONCILE_RETRY_S, endpoint_id)

    async def _probe(self, endpoint: StoredEndpoint, version: int) -> None:
        """Deliver exactly one message while the breaker is half open and this replica is the prober."""

        def still_mine() -> bool:
            command = self._breakers.state(endpoint.id)
            return not self._changes.stopping and command is not None and command.version == version

        queue_name = topology.endpoint_queue(endpoint.id, endpoint.queue_generation)
        while still_mine():
            try:
                async with self._broker.channel() as channel:
                    queue = await channel.get_queue(queue_name, ensure=False)
                    while still_mine():
                        message = await queue.get(no_ack=False, fail=False, timeout=CALL_TIMEOUT_S)
                        if message is None:
                            await asyncio.sleep(PROBE_POLL_S)  # nothing to probe with yet
                            continue
                        log.info("breaker_probe", endpoint_id=endpoint.id, version=version)
                        if await handle_safely(self._handler, endpoint.id, message, probe=True):
                            return
                        # No attempt came of it (an invalid event, a deferral): probe with the next one.
            except BROKER_ERRORS as exc:
                log.warning("breaker_probe_failed", endpoint_id=endpoint.id, error=type(exc).__name__)
                await asyncio.sleep(PROBE_POLL_S)


async def expire_breakers(breakers: BreakerView, changes: Changes, loop: Loop) -> None:
    """Breakers no monitor renewed within the lease are closed here: never blocked on a silent monitor."""
    while True:
        for command in breakers.expire(now_s=time.monotonic()):
            log.error(
                "breaker_expired",
                endpoint_id=command.endpoint_id,
                state=command.state.value,
                alert=True,
                detail="no health monitor renewed this breaker; delivering again",
            )
            metrics.BREAKERS_EXPIRED.inc()
            changes.on_breakers([command.endpoint_id])
        loop.mark_up()
        await asyncio.sleep(1.0)
