"""Endpoints whose breaker has stayed open longer than ``HOOKLINE_DISABLE_AFTER_S`` (the leader's): disabled
in the registry, their tenant told with the event ``hookline.endpoint.disabled``, their breaker forgotten."""

from __future__ import annotations

import structlog

from hookline.health_monitor.commands import BreakerCommands
from hookline.health_monitor.monitorstate import MonitorState
from hookline.health_monitor.publishing import publish_event
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import EndpointStatus, Event, StoredEndpoint

log = structlog.get_logger(__name__)

DISABLED_EVENT_TYPE = "hookline.endpoint.disabled"


class Disabling:
    def __init__(self, state: MonitorState, commands: BreakerCommands) -> None:
        self._state = state
        self._commands = commands

    async def disable_due(self, *, now_s: float) -> None:
        """Those open too long; none while the broker refuses this monitor's publishes (an alarm)."""
        health = self._state.health
        for endpoint_id in [] if self._state.broker.blocked else health.to_disable(now_s=now_s):
            await self._disable(endpoint_id, now_s=now_s)

    async def _disable(self, endpoint_id: str, *, now_s: float) -> None:
        """Open longer than the limit: disable the endpoint and tell its tenant with an event; then
        forget its breaker. In that order: a breaker closed while the endpoint is still active lets the
        dispatchers attempt what waits in its queue, and those failures opened the breaker of the
        disabled endpoint again, which told its tenant ``endpoint.failing`` after ``endpoint.disabled``."""
        log.info("endpoint_disabling", endpoint_id=endpoint_id)  # the write below may wait (a lost network)
        # A paused endpoint stays paused: its tenant stopped it, the breaker did not.
        endpoint = await self._state.change_log.disable(
            endpoint_id,
            unless=frozenset({EndpointStatus.PAUSED}),
            timeout_s=self._state.settings.connect_timeout_s,
        )
        if endpoint is not None:
            await self._tell_disabled(endpoint)
        self._commands.put(self._state.health.reset(endpoint_id, now_s=now_s))

    async def _tell_disabled(self, endpoint: StoredEndpoint) -> None:
        """The tenant's event ``hookline.endpoint.disabled``, and the alert's log line."""
        now = endpoint.updated_at
        reason = f"circuit breaker open for more than {self._state.settings.disable_after_s:.0f} s"
        event = Event(
            id=new_id("evt"),
            type=DISABLED_EVENT_TYPE,
            tenant=endpoint.tenant,
            occurred_at=now,
            data={
                "endpoint_id": endpoint.id,
                "url": endpoint.url,
                "reason": reason,
                "disabled_at": now.isoformat(),
            },
        )
        await publish_event(self._state.publisher, event)
        log.warning(
            "endpoint_disabled", endpoint_id=endpoint.id, tenant=endpoint.tenant, reason=reason, alert=True
        )
