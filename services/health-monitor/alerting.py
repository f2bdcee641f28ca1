"""Alerts as the world is told of them: evaluated every few ticks (alerts.py decides what fires); when this
monitor leads, each alert that fired or resolved since is logged, published to the alerts exchange, sent
to the sinks and notified to the endpoint's tenant. The alert book and the messages the broker has not
taken yet are saved (checkpoint.py) before they are sent, and loaded back at start-up."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

import aio_pika
import orjson
import structlog

from hookline.health_monitor import checkpoint
from hookline.health_monitor.alerts import Alert, AlertBook, AlertKey, AlertPolicy, broker_alerts, evaluate
from hookline.health_monitor.canary import canary_endpoints
from hookline.health_monitor.health import Health
from hookline.health_monitor.monitorstate import MonitorState
from hookline.health_monitor.sinks import AlertSinks
from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Broker
from hookline.shared.broker.heldpublishes import HeldPublishes
from hookline.shared.contracts import addressing
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import StoredEndpoint
from hookline.shared.state import notifications
from hookline.shared.state.registry import EndpointRegistry

log = structlog.get_logger(__name__)

UNSENT_MAX = 1_000


class Alerting:
    def __init__(
        self,
        state: MonitorState,
        sinks: AlertSinks,
        store: checkpoint.CheckpointStore,
        restored: checkpoint.AlertState | None,
    ) -> None:
        """``restored``: the alert book a checkpoint gave back (None: none)."""
        self._state = state
        self._sinks = sinks
        self._store = store
        settings = state.settings
        self.policy = AlertPolicy(
            slow_p95_ms=settings.slow_p95_ms,
            oldest_pending_s=settings.oldest_pending_alert_s,
            broker_disk_headroom_bytes=settings.broker_disk_headroom_bytes,
            broker_fd_ratio=settings.broker_fd_ratio,
            disable_after_s=settings.disable_after_s,
        )
        # Alerts and notifications the broker has not taken yet (it refused publishes, or they were just
        # written down): sent, in order, once it takes them. Saved with the alert book.
        self._unsent = HeldPublishes(
            state.publisher, max_held=UNSENT_MAX, held=restored.unsent if restored else ()
        )
        # What fires, as the world was told (a restart goes on from the saved book).
        self.alerts = AlertBook(restored.firing if restored else None)
        self._alerts_saved: bytes | None = None

    async def alert(self, *, now_s: float) -> None:
        """Evaluate the alerts; when leading, tell the world of each that fired or resolved since. What
        is told is written down (the book and the messages) before it is sent: a restart neither tells
        it twice nor forgets it."""
        if not self._state.contended:
            return  # not yet known whether this monitor leads: the book would take changes in untold
        current = await self._current_alerts(now_s=now_s)
        fired, resolved = self.alerts.update(current)
        if self._state.leader:  # a standby knows what fires (its API says so); the leader tells the world
            for state, changed in (("firing", fired), ("resolved", resolved)):
                for alert in changed:
                    self._publish_alert(alert, state, now_s)
                    self._notify(alert, state, now_s)
        await self.save()
        if self._unsent:
            await self._unsent.flush()
            await self.save()

    async def save(self) -> None:
        """The alert book and the messages still to send, when they changed since the last save."""
        data = checkpoint.dump_alerts(self.alerts.firing, self._unsent.items())
        if data != self._alerts_saved:
            await self._store.save_alerts(data, identity=alerts_identity(self._state.broker))
            self._alerts_saved = data

    async def _current_alerts(self, *, now_s: float) -> dict[AlertKey, Alert]:
        state, settings = self._state, self._state.settings
        recent = await state.dead_letters.counts_since(
            datetime.fromtimestamp(now_s, UTC) - timedelta(minutes=5)
        )
        missing, state.missing_since_evaluation = {**state.missing_since_evaluation, **state.missing}, {}
        return evaluate(
            state.health,
            endpoints_to_evaluate(state.registry, state.health, recent, missing),
            recent_dead_letters=lambda endpoint_id: recent.get(endpoint_id, 0),
            missing=missing,
            others=[
                *broker_alerts(state.capacity, blocked=state.broker.blocked, policy=self.policy),
                *state.canaries.alerts(
                    canary_endpoints(state.registry, settings.canary_tenant),
                    tenant=settings.canary_tenant,
                    now_s=now_s,
                    late_s=settings.canary_late_s,
                ),
            ],
            now_s=now_s,
            policy=self.policy,
        )

    def _notify(self, alert: Alert, state: str, now_s: float) -> None:
        """Tell the endpoint's tenant, at its notify_url, through its notifier's queue (retried there)."""
        registry = self._state.registry
        endpoint = registry.get(alert.endpoint_id) if alert.endpoint_id else None
        notice = notifications.notice_for(alert.name, state, endpoint)
        if notice is None or endpoint is None:
            return
        notifier_id = notifications.notifier_of(endpoint)
        notifier = registry.get(notifier_id) if notifier_id else None
        if notifier is None:
            log.warning("notifier_missing", endpoint_id=endpoint.id, notifier_id=notifier_id)
            return
        event = notifications.notification(
            notice, endpoint, alert.detail, now=datetime.fromtimestamp(now_s, UTC)
        )
        message = addressing.message(
            event.model_dump_json(exclude_none=True).encode(),
            event_id=event.id,
            endpoint_id=notifier.id,
            timestamp=event.occurred_at,
        )
        log.info(
            "notification",
            notice=notice.value,
            endpoint_id=endpoint.id,
            tenant=endpoint.tenant,
            notifier_id=notifier.id,
            event_id=event.id,
        )
        # To its address as it is now: a queue gone by the time it is sent makes it unroutable, and a
        # dispatcher forwards it (addressing.py).
        self._unsent.hold(
            message,
            exchange=topology.DELAY_DELIVERY,
            routing_key=topology.delay_routing_key(0, registry.placements.address(notifier)),
            what="notification",
        )

    def _publish_alert(self, alert: Alert, state: str, now_s: float) -> None:
        body = {
            "alert": alert.name,
            "state": state,
            "endpoint_id": alert.endpoint_id,
            "tenant": alert.tenant,
            "detail": alert.detail,
            "at": datetime.fromtimestamp(now_s, UTC).isoformat(),
        }
        log.warning("alert", **body)
        message = aio_pika.Message(
            orjson.dumps(body),
            content_type="application/json",
            message_id=new_id("alert"),
            type=f"{alert.name}.{state}",
        )
        assert message.message_id is not None
        self._sinks.send(message.message_id, body)
        self._unsent.hold(
            message, exchange=topology.ALERTS_EXCHANGE, routing_key=message.type or "", what="alert"
        )


def endpoints_to_evaluate(
    registry: EndpointRegistry,
    health: Health,
    recent_dead_letters: Mapping[str, int],
    missing: Mapping[str, str | None],
) -> dict[str, StoredEndpoint]:
    """The endpoints an alert may be about: those with telemetry, recent dead letters or a queue
    found missing, and those with queues of their own (a disabled endpoint's among them); never a
    walk over every registered endpoint."""
    ids = {*health.endpoints, *recent_dead_letters, *filter(None, missing.values())}
    found = {endpoint_id: e for endpoint_id in ids if (e := registry.get(endpoint_id)) is not None}
    return {**found, **{endpoint.id: endpoint for endpoint in registry.placements.with_queues()}}


def alerts_identity(broker: Broker) -> str:
    """Whose alert book: the monitors of one vhost tell of its endpoints and queues."""
    return f"{broker.vhost}/{topology.ALERTS_EXCHANGE}"


async def load_alerts(store: checkpoint.CheckpointStore, broker: Broker) -> checkpoint.AlertState | None:
    """The alert book saved by this monitor before; without one, whatever fires now is told once more."""
    data = await store.read_alerts(alerts_identity(broker))
    if data is None:
        return None
    try:
        state = checkpoint.load_alerts(data)
    except checkpoint.CheckpointError as exc:
        log.warning("alert_book_unusable", error=str(exc)[:200])
        return None
    log.info("alert_book_restored", firing=len(state.firing), unsent=len(state.unsent))
    return state
