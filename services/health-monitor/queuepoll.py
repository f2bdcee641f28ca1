"""The queue poll, every ``HOOKLINE_QUEUE_POLL_S``: the depths of the core queues, the lanes and the
endpoints' own queues by passive declares; what is found missing (declared again when leading,
repair.py); then the sweeps that go with each poll (placements, bindings, sweeps.py)."""

from __future__ import annotations

import asyncio

from hookline.health_monitor import metrics
from hookline.health_monitor.bindings import Bindings
from hookline.health_monitor.monitorstate import MonitorState
from hookline.health_monitor.placements import Placements
from hookline.health_monitor.repair import Repair
from hookline.health_monitor.sweeps import Sweeps
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import QueueProbe
from hookline.shared.runtime.supervision import Loop


class QueuePoll:
    def __init__(
        self,
        state: MonitorState,
        probe: QueueProbe,
        placements: Placements,
        bindings: Bindings,
        sweeps: Sweeps,
        repair: Repair,
    ) -> None:
        self._state = state
        self._probe = probe
        self._placements = placements
        self._bindings = bindings
        self._sweeps = sweeps
        self._repair = repair

    async def poll_queues(self, loop: Loop) -> None:
        """Queue depths by passive declares; missing queues and streams found (and, when leading,
        declared again); queues left behind removed once they have stayed empty long enough."""
        loop.mark_up()
        while True:
            try:
                await self._poll_once()
            finally:
                await self._probe.close()
            loop.beat()
            await asyncio.sleep(self._state.settings.queue_poll_s)

    async def _poll_once(self) -> None:
        state, registry = self._state, self._state.registry
        core = {name: await self._probe.depth(name) for name in topology.core_queues()}
        levels = (topology.delay_level(level) for level in range(topology.DELAY_BITS))
        state.awaiting_retry = sum(core[name] or 0 for name in levels)
        state.lanes_pending = sum(core[name] or 0 for name in topology.lane_queues())
        for name in topology.lane_queues():
            metrics.LANE_DEPTH.labels(name).set(core[name] or 0)
        missing: dict[str, str | None] = {name: None for name, depth in core.items() if depth is None}
        # Only endpoints with a queue of their own have a depth of their own; the others' events pass
        # through their lane (pending there, in lanes_pending).
        depths: dict[str, int | None] = {}
        for endpoint in registry.placements.with_queues():
            if not registry.placements.has_queue(endpoint.id):
                continue
            queue = topology.own_queue(endpoint)
            depth = depths[endpoint.id] = await self._probe.depth(queue)
            state.health.endpoint(endpoint.id).queue_depth = depth
            if depth is None and registry.placements.isolated(endpoint):
                missing[queue] = endpoint.id
        for endpoint_id, health in state.health.endpoints.items():
            if endpoint_id not in depths:
                health.queue_depth = None
        await self._placements.sweep(depths, leader=state.leader)
        await self._bindings.sweep(leader=state.leader)
        await self._sweeps.sweep_retired()
        await self._sweeps.sweep_notifiers()
        state.missing = missing
        state.missing_since_evaluation.update(missing)
        if missing and state.leader:
            await self._repair.repair(missing)
