"""Canaries: an event the leading monitor publishes to ``events`` every ``HOOKLINE_CANARY_INTERVAL_S``
(off by default) for the canary tenant (``HOOKLINE_CANARY_TENANT``), delivered like any other to the
endpoints an operator registered for it (``hookline synthetic``'s ``/ok`` will do). The whole path is
measured, publish to delivery, from the outside in: an accepted event that stops arriving is seen
even when every service says it is healthy.

The book below is pure: it learns what was sent (from the canaries' ids, which carry their time) and
what arrived (from the telemetry the dispatchers already publish), and says which alerts fire.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from hookline.health_monitor.alerts import Alert
from hookline.shared.contracts.ids import id_time_s
from hookline.shared.contracts.telemetry import AttemptRecord, Outcome

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
