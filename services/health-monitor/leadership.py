"""Which monitor leads, and the breaker states as the breaker log says.

Any number of monitors may run; exactly one leads, the one holding the exclusive queue
``hookline.monitor.leader`` (the broker deletes it with its owner's connection, so a standby takes over
within a second of the leader's death, or within a heartbeat timeout of a network cut). A standby
mirrors the breaker states from the breaker log; the leader alone moves them, and one that takes over
starts from what the log says the previous leader left.
"""

from __future__ import annotations

import asyncio

import aiormq
import structlog
from pydantic import ValidationError

from hookline.health_monitor import metrics
from hookline.health_monitor.breaker import Breaker
from hookline.health_monitor.direct import Direct
from hookline.health_monitor.monitorstate import MonitorState
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import CALL_TIMEOUT_S, until_closed
from hookline.shared.broker.streams import Record, offset_of
from hookline.shared.contracts.control import BreakerView, control_record
from hookline.shared.contracts.models import error_summary
from hookline.shared.runtime.supervision import Loop

log = structlog.get_logger(__name__)

LEADER_RETRY_S = 1.0


class Leadership:
    def __init__(self, state: MonitorState, direct: Direct) -> None:
        self._state = state
        self._direct = direct
        self._breaker_log = BreakerView()  # the breaker states as the log says (a standby mirrors them)

    # --- what the breaker log says ---------------------------------------------------------------

    def on_breaker_log(self, message: Record) -> None:
        try:
            record = control_record.validate_json(message.body)
        except ValidationError as exc:
            log.error("control_record_unreadable", offset=offset_of(message), error=error_summary(exc))
            return
        changed = self._breaker_log.apply(record)
        if not self._state.leader:
            for endpoint_id in changed:
                self._mirror(endpoint_id)

    def restore_breakers(self) -> None:
        """At start: the breakers as the log says. When the log has a snapshot (some monitor led in the
        last minutes) it is the whole truth, so a breaker the checkpoint has open but the log no longer
        lists has closed since; without one, the log's commands are applied over the checkpoint."""
        health = self._state.health
        if self._breaker_log.saw_snapshot:
            for endpoint_id in list(health.endpoints):
                self._mirror(endpoint_id)
        for command in self._breaker_log.commands():
            health.restore(command)

    def _mirror(self, endpoint_id: str) -> None:
        """Take the breaker state of an endpoint from the log (what the leader decided)."""
        command = self._breaker_log.state(endpoint_id)
        if command is not None:
            self._state.health.restore(command)
        elif endpoint_id in self._state.health.endpoints:
            health = self._state.health.endpoints[endpoint_id]
            health.breaker, health.command = Breaker(), None

    # --- the lead --------------------------------------------------------------------------------

    async def lead_when_possible(self, loop: Loop) -> None:
        """Hold the leader lock while this monitor's connection lives; otherwise stand by and try again
        every second. Losing the channel (or the connection) ends the leadership at once."""
        loop.mark_up()
        while True:
            async with self._state.broker.channel() as channel:
                try:
                    await channel.declare_queue(
                        topology.MONITOR_LEADER_LOCK, exclusive=True, timeout=CALL_TIMEOUT_S
                    )
                except aiormq.exceptions.ChannelLockedResource:
                    self._state.contended = True  # another monitor leads
                else:
                    self._state.contended = True
                    self._take_over()
                    try:
                        await until_closed(channel)
                    finally:
                        self._stand_by()
            loop.beat()
            await asyncio.sleep(LEADER_RETRY_S)

    def _take_over(self) -> None:
        # The breakers as the previous leader left them (the log), then this monitor decides.
        health = self._state.health
        for endpoint_id in list(health.endpoints):
            self._mirror(endpoint_id)
        for command in self._breaker_log.commands():
            health.restore(command)
        for endpoint in health.endpoints.values():
            # A probe asked for before this monitor led may have reported to nobody (its attempt record
            # lost with a connection): a half-open breaker gets a probe assigned afresh at the next tick
            # rather than after PROBE_TIMEOUT_S.
            endpoint.probe_asked_at_s = 0.0
        self._direct.forget_bound()  # a route recorded by the leader before may not be bound yet
        self._state.leader = True
        metrics.LEADER.set(1)
        log.warning("monitor_leading", breakers_open=len(self._breaker_log.commands()))

    def _stand_by(self) -> None:
        if self._state.leader:
            log.warning("monitor_standing_by")
        self._state.leader = False
        metrics.LEADER.set(0)
