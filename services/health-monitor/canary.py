"""Canaries: an event the leading monitor publishes to ``events`` every ``HOOKLINE_CANARY_INTERVAL_S``
(off by default) for the canary tenant (``HOOKLINE_CANARY_TENANT``), delivered like any other to the
endpoints an operator registered for it (``hookline synthetic``'s ``/ok`` will do). The whole path is
measured, publish to delivery, from the outside in: an accepted event that stops arriving is seen
even when every service says it is healthy.

The book is pure: it learns what was sent (from the canaries' ids, which carry their time) and
what arrived (from the telemetry the dispatchers already publish), and says which alerts fire. The
sender is the I/O: the leader's loop that publishes them.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import structlog

from hookline.health_monitor import metrics
from hookline.health_monitor.alerts import Alert
from hookline.health_monitor.publishing import publish_event
from hookline.shared.broker.amqp import BROKER_ERRORS
from hookline.shared.contracts.ids import id_time_s, new_id
from hookline.shared.contracts.models import EndpointStatus, Event
from hookline.shared.contracts.telemetry import AttemptRecord, Outcome
from hookline.shared.runtime.supervision import Loop
from hookline.shared.state.registry import EndpointRegistry

if TYPE_CHECKING:  # the state holds the book below
    from hookline.health_monitor.monitorstate import MonitorState

log = structlog.get_logger(__name__)

CANARY_TYPE = "hookline.canary"
KEEP = 100  # canaries remembered: enough for the late alert, bounded whatever the interval


class CanaryBook:
    def __init__(self) -> None:
        self.sent: OrderedDict[str, float] = OrderedDict()  # event id -> sent at (unix s)
        self.latency_s: dict[str, float] = {}  # endpoint -> the last canary's publish-to-delivery time
        self._arrived: dict[str, float] = {}  # endpoint -> send time of the newest canary it took
        self._failing: dict[str, str] = {}  # endpoint -> how its last canary attempt failed

    def sending(self, event_id: str) -> None:
        sent_at_s = id_time_s(event_id)
        if sent_at_s is None:
            raise ValueError(f"{event_id}: canaries carry their send time in a ULID id")
        self.sent[event_id] = sent_at_s
        while len(self.sent) > KEEP:
            self.sent.popitem(last=False)

    def on_attempt(self, record: AttemptRecord) -> None:
        if record.type != CANARY_TYPE:
            return
        sent_at_s = id_time_s(record.event_id)
        if sent_at_s is None:
            return
        if record.outcome is Outcome.SUCCESS:
            self._failing.pop(record.endpoint_id, None)
            if sent_at_s >= self._arrived.get(record.endpoint_id, 0.0):
                self._arrived[record.endpoint_id] = sent_at_s
                self.latency_s[record.endpoint_id] = max(0.0, record.at_s - sent_at_s)
        else:
            self._failing[record.endpoint_id] = (
                f"HTTP {record.status}" if record.status is not None else record.error or "no answer"
            )

    def alerts(self, endpoints: Iterable[str], *, tenant: str, now_s: float, late_s: float) -> list[Alert]:
        """``canary_failed`` while an endpoint's last canary attempt failed; ``canary_late`` when a
        canary sent at least ``late_s`` ago has not reached it and nothing sent after it has either."""
        alerts = []
        for endpoint_id in endpoints:
            failing = self._failing.get(endpoint_id)
            if failing is not None:
                alerts.append(
                    Alert("canary_failed", endpoint_id, tenant, f"the last canary attempt failed ({failing})")
                )
            arrived_s = self._arrived.get(endpoint_id, float("-inf"))
            waiting = [sent_s for sent_s in self.sent.values() if sent_s > arrived_s]
            if waiting and now_s - min(waiting) >= late_s:
                alerts.append(
                    Alert(
                        "canary_late", endpoint_id, tenant,
                        f"{len(waiting)} canaries not delivered, the oldest sent {now_s - min(waiting):.0f} s ago",
                    )
                )  # fmt: skip
        return alerts


def canary_endpoints(registry: EndpointRegistry, tenant: str) -> list[str]:
    """The endpoints that take canaries: the canary tenant's active ones."""
    return [
        endpoint.id
        for endpoint in registry.rows.of_tenant(tenant)
        if endpoint.status is EndpointStatus.ACTIVE
    ]


class CanarySender:
    def __init__(self, state: MonitorState) -> None:
        self._state = state

    async def send_canaries(self, loop: Loop) -> None:
        """While leading, a canary event every HOOKLINE_CANARY_INTERVAL_S, if an endpoint takes them."""
        state, tenant = self._state, self._state.settings.canary_tenant
        loop.mark_up()
        while True:
            loop.beat()
            if state.leader and canary_endpoints(state.registry, tenant):
                now = datetime.now(UTC)
                canary = Event(
                    id=new_id("evt"), type=CANARY_TYPE, tenant=tenant, occurred_at=now,
                    data={"sent_at": now.isoformat()},
                )  # fmt: skip
                state.canaries.sending(canary.id)
                try:
                    await publish_event(state.publisher, canary)
                    metrics.CANARIES_SENT.inc()
                except BROKER_ERRORS as exc:
                    # Not sent is as good as not delivered: canary_late says so in a moment.
                    log.warning("canary_unpublished", error=type(exc).__name__)
            await asyncio.sleep(state.settings.canary_interval_s)
