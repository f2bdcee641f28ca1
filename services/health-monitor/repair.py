"""Queues and streams the queue poll found missing, declared again by the leader: the core topology (when
this monitor may declare it), the tenants' bindings of a lane declared again, the endpoints' own queues."""

from __future__ import annotations

import asyncio

import structlog

from hookline.health_monitor.direct import Direct
from hookline.health_monitor.monitorstate import MonitorState
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import QueueProbe

log = structlog.get_logger(__name__)

#: How long a repair waits for core names it may not declare itself (the ingest declares them).
REPAIR_WAIT_S = 5.0


class Repair:
    def __init__(self, state: MonitorState, probe: QueueProbe, direct: Direct) -> None:
        self._state = state
        self._probe = probe
        self._direct = direct

    async def repair(self, found_missing: dict[str, str | None]) -> None:
        for name, endpoint_id in sorted(found_missing.items(), key=lambda item: item[0]):
            log.error("queue_missing", queue=name, endpoint_id=endpoint_id, alert=True)
        # Not at once: the consumers of the queue deleted must have been told first (REDECLARE_AFTER_S).
        # A dispatcher that was told may have declared its queue of its own again meanwhile.
        await asyncio.sleep(topology.REDECLARE_AFTER_S)
        missing = {name: e for name, e in found_missing.items() if await self._probe.depth(name) is None}
        if not missing:
            return
        broker, registry = self._state.broker, self._state.registry
        if any(endpoint_id is None for endpoint_id in missing.values()):
            try:
                await topology.declare(broker, self._state.settings.retention, timeout_s=REPAIR_WAIT_S)
            except topology.TopologyMissingError as exc:
                # A monitor with least privilege may not declare the core topology (only the ingest
                # does, at its start): the alert above stands; endpoint queues are still repaired.
                log.error("topology_not_repairable", detail=str(exc))
            else:
                await self._rebind_lanes({name for name in missing if topology.is_lane(name)})
        for endpoint_id in {endpoint_id for endpoint_id in missing.values() if endpoint_id}:
            endpoint = registry.get(endpoint_id)
            if endpoint is not None and registry.placements.isolated(endpoint):
                async with broker.channel() as channel:
                    await topology.declare_own_queue(channel, endpoint)
                self._direct.forget_bound()  # declared again without its direct route, if it had one
        log.warning("topology_repaired", declared=sorted(missing))

    async def _rebind_lanes(self, lanes: set[str]) -> None:
        """Lanes declared again (deleted by hand, lost with a node): every tenant pattern they held."""
        if not lanes:
            return
        registry = self._state.registry
        async with self._state.broker.channel() as channel:
            for tenant in registry.rows.tenants():
                if topology.lane_of(tenant) in lanes:
                    await topology.bind_patterns(
                        channel, tenant, registry.subscriptions.patterns_needed(tenant)
                    )
        log.warning("lanes_bound_again", lanes=sorted(lanes))
