"""What the health monitor's parts share (monitor.py wires them): the services every part talks to, the
picture of the endpoints, whether this monitor is live and leads, and what the last polls found, which
the alerts, the metrics and the status API read."""

from __future__ import annotations

from dataclasses import dataclass, field

from hookline.health_monitor.canary import CanaryBook
from hookline.health_monitor.health import Health
from hookline.health_monitor.settings import MonitorSettings
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.broker.capacity import BrokerCapacity
from hookline.shared.state.deadletterindex import DeadLetterIndex
from hookline.shared.state.registry import ChangeLog, EndpointRegistry


@dataclass
class MonitorState:
    settings: MonitorSettings
    broker: Broker
    publisher: Publisher
    change_log: ChangeLog
    health: Health
    dead_letters: DeadLetterIndex
    canaries: CanaryBook = field(default_factory=CanaryBook)
    live: bool = False  # caught up with telemetry: records now move breakers (when leading)
    leader: bool = False
    # Whether this monitor has tried for the lead once: until then an alert evaluation would take
    # into the book, untold, what a leader is about to tell.
    contended: bool = False
    capacity: BrokerCapacity | None = None  # the broker's last reading (None: unreadable)
    awaiting_retry: int = 0
    lanes_pending: int = 0  # ready messages in the lanes (read with the core queues)
    missing: dict[str, str | None] = field(
        default_factory=dict
    )  # queue or stream -> its endpoint (None: core)
    # Found missing since the last alert evaluation: the leader declares it again within the same
    # poll, so without this the alert would fire only if an evaluation happened to fall in between.
    missing_since_evaluation: dict[str, str | None] = field(default_factory=dict)

    @property
    def registry(self) -> EndpointRegistry:
        return self.change_log.registry
