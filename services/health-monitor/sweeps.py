"""What the queue poll removes, when leading, once it has stayed unused for its grace period: queues that
endpoints have left (a move, a deletion), once drained; notifiers no endpoint names any more."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import structlog

from hookline.health_monitor.monitorstate import MonitorState
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import CALL_TIMEOUT_S, QueueProbe
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import EndpointDeleted, StoredEndpoint
from hookline.shared.state import notifications
from hookline.shared.state.registry import StaleWriteError

log = structlog.get_logger(__name__)

#: Deleted endpoints whose queues are still watched until drained and removed.
DELETED_WATCH_WINDOW = timedelta(days=1)


class Sweeps:
    def __init__(self, state: MonitorState, probe: QueueProbe) -> None:
        self._state = state
        self._probe = probe
        self._empty_since_s: dict[str, float] = {}  # retired queue -> when it was first seen empty
        self._unnamed_since_s: dict[str, float] = {}  # notifier -> when no endpoint named it any more

    async def sweep_retired(self) -> None:
        """Queues endpoints have left (a move, a deletion) are drained by the dispatchers; once one has
        stayed empty for the grace period, nothing can come back to it any more and it is removed."""
        registry = self._state.registry
        since = datetime.now(UTC) - DELETED_WATCH_WINDOW
        retired = [name for endpoint in registry.placements.with_queues() for name in endpoint.retired_queues]
        retired += [
            name
            for endpoint in registry.deletions.deleted_with_queues_since(since)
            for name in topology.endpoint_queues(endpoint)
        ]
        now_s = time.monotonic()
        for name in retired:
            depth = await self._probe.depth(name)
            if depth != 0:
                self._empty_since_s.pop(name, None)
                continue
            empty_since_s = self._empty_since_s.setdefault(name, now_s)
            if self._state.leader and now_s - empty_since_s >= self._state.settings.retired_queue_grace_s:
                async with self._state.broker.channel() as channel:
                    await channel.queue_delete(name, timeout=CALL_TIMEOUT_S)
                self._empty_since_s.pop(name, None)
                log.info("queue_removed", queue=name, endpoint_id=topology.endpoint_of(name))

    async def sweep_notifiers(self) -> None:
        """A notifier no endpoint names any more (a notify_url changed or removed, its endpoints deleted)
        is removed once it has stayed unnamed for the grace period (named again meanwhile, it stays, its
        secret unchanged). Removed as an endpoint is deleted: what its queue still holds is dead-lettered,
        and the queue goes once drained (:meth:`sweep_retired`)."""
        unnamed = {notifier.id: notifier for notifier in self._unnamed_notifiers()}
        for notifier_id in set(self._unnamed_since_s) - set(unnamed):
            del self._unnamed_since_s[notifier_id]
        now_s = time.monotonic()
        for notifier in unnamed.values():
            unnamed_since_s = self._unnamed_since_s.setdefault(notifier.id, now_s)
            if self._state.leader and now_s - unnamed_since_s >= self._state.settings.notifier_grace_s:
                await self._remove_notifier(notifier.id)

    def _unnamed_notifiers(self) -> list[StoredEndpoint]:
        registry = self._state.registry
        return notifications.unnamed_notifiers(
            registry.rows.of_tenant(notifications.OPERATOR_TENANT), registry.rows.notifier_named
        )

    async def _remove_notifier(self, notifier_id: str) -> None:
        change_log, timeout_s = self._state.change_log, self._state.settings.connect_timeout_s
        # Up to date first: an endpoint may have named it a moment ago on an ingest.
        await change_log.sync(timeout_s=timeout_s)
        unnamed = {notifier.id: notifier for notifier in self._unnamed_notifiers()}
        notifier = unnamed.get(notifier_id)
        if notifier is None:
            return
        record = EndpointDeleted(
            change_id=new_id("chg"),
            at=datetime.now(UTC),
            endpoint_id=notifier.id,
            base_version=notifier.version,
        )
        try:
            await change_log.write(record, timeout_s=timeout_s)
        except StaleWriteError:
            return  # changed meanwhile (an ingest resumed it): looked at again at the next poll
        if not notifier.laned:
            async with self._state.broker.channel() as channel:
                await topology.unroute_legacy(channel, notifier)
        self._unnamed_since_s.pop(notifier.id, None)
        log.info("notifier_removed", endpoint_id=notifier.id, description=notifier.description)
