"""The leader's breaker commands: taken in as health.py decides them (from telemetry, a tick, an endpoint
disabled) and published in order to the control exchange, an endpoint whose breaker opens isolated
first; and the snapshot of every breaker, published every few seconds, which carries any command lost
on the way."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

import structlog

from hookline.health_monitor.monitorstate import MonitorState
from hookline.health_monitor.placements import Placements
from hookline.health_monitor.publishing import publish_control
from hookline.shared.broker.amqp import BROKER_ERRORS
from hookline.shared.contracts.control import BreakerCommand, BreakerState
from hookline.shared.runtime.supervision import Loop

log = structlog.get_logger(__name__)


class BreakerCommands:
    def __init__(self, state: MonitorState, placements: Placements) -> None:
        self._state = state
        self._placements = placements
        self._outbox: asyncio.Queue[BreakerCommand] = asyncio.Queue()

    def put(self, commands: Iterable[BreakerCommand]) -> None:
        for command in commands:
            self._outbox.put_nowait(command)

    async def publish_commands(self, loop: Loop) -> None:
        loop.mark_up()
        while True:
            command = await self._outbox.get()
            loop.beat()
            if not self._state.leader:
                continue
            if command.state is BreakerState.OPEN:
                # Its events wait in a queue of its own while the breaker is open, not in its lane.
                await self._placements.isolate_for_breaker(command.endpoint_id)
            try:
                await publish_control(self._state.publisher, command)
            except BROKER_ERRORS as exc:
                # Not lost: the next snapshot (every few seconds) carries the state anyway.
                log.warning(
                    "breaker_command_unpublished", endpoint_id=command.endpoint_id, error=type(exc).__name__
                )
                continue
            log.warning(
                "breaker_changed",
                endpoint_id=command.endpoint_id,
                state=command.state.value,
                probe_by=command.probe_by,
                cooldown_s=command.cooldown_s,
            )

    async def publish_snapshot(self, *, now_s: float) -> None:
        with contextlib.suppress(*BROKER_ERRORS):  # the next one, in a few seconds
            await publish_control(self._state.publisher, self._state.health.snapshot(now_s=now_s))
