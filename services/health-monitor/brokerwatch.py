"""The broker's capacity, watched: its alarms, free disk and file handles, read every
``HOOKLINE_BROKER_POLL_S`` for the alerts, /metrics and /v1/status."""

from __future__ import annotations

import asyncio

import structlog

from hookline.health_monitor import metrics
from hookline.health_monitor.monitorstate import MonitorState
from hookline.shared.broker.capacity import CapacityReader
from hookline.shared.runtime.supervision import Loop

log = structlog.get_logger(__name__)


async def watch_broker(state: MonitorState, reader: CapacityReader, loop: Loop) -> None:
    """The broker's alarms, free disk and file handles, read every few seconds (for alerts, /metrics
    and /v1/status); without a source only the publishing connection's state tells of an alarm."""
    log.info("broker_capacity_source", source=reader.source, target=reader.target)
    loop.mark_up()
    while True:
        state.capacity = await reader.recent(max_age_s=0)
        metrics.export_capacity(state.capacity)
        loop.beat()
        await asyncio.sleep(state.settings.broker_poll_s)
