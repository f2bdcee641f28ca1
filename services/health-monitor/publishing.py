"""What the health monitor publishes as any publisher of the system does (confirmed): its control
records, breaker commands and snapshots, to the control exchange; events of its own (an endpoint
disabled, canaries) to ``events``."""

from __future__ import annotations

import aio_pika

from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Publisher
from hookline.shared.contracts.control import ControlRecord, control_record
from hookline.shared.contracts.envelope import event_message
from hookline.shared.contracts.ids import new_id
from hookline.shared.contracts.models import Event


async def publish_control(publisher: Publisher, record: ControlRecord) -> None:
    await publisher.publish(
        aio_pika.Message(
            control_record.dump_json(record),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=new_id("ctl"),
        ),
        exchange=topology.CONTROL_EXCHANGE,
        routing_key="",
    )


async def publish_event(publisher: Publisher, event: Event) -> None:
    """To ``events``, as an upstream publishes (confirmed): delivered like any other event."""
    await publisher.publish(
        event_message(
            event, event.model_dump_json(exclude_none=True).encode(), accepted_at=event.occurred_at
        ),
        exchange=topology.EVENTS_EXCHANGE,
        routing_key=topology.event_routing_key(event.tenant, event.type),
    )
