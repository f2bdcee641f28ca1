"""Messages meant for one endpoint (retries, deferrals, hand-offs, replays, redrives, notifications):
built with the endpoint's id and sent to its address, never dropped.

An endpoint's address is its queue of its own while it has one, else its tenant's lane
(:meth:`~hookline.shared.state.placementbook.PlacementBook.address`). Every such message goes through the delay
hierarchy, straight to its last exchange when it is not to wait (``hookline.delay.delivery``), whose
routing key names the queue: a queue that no longer exists (removed once drained, or deleted by hand)
makes the message unroutable, and the exchange's alternate keeps it in ``hookline.delay.unroutable``,
where a dispatcher forwards it to the endpoint's address as it is by then (or dead-letters it, the
endpoint being gone). A ``mandatory`` publish by name would learn of a missing queue too, but the client
matches a return to its publish by ``message_id``, which is the event id here and is shared by the
copies of one event to several endpoints in flight at once: a return could answer the wrong publish.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

import aio_pika

from hookline.shared.broker import topology
from hookline.shared.broker.amqp import Publisher
from hookline.shared.contracts.headers import Header


def message(
    body: bytes,
    *,
    event_id: str,
    endpoint_id: str,
    content_type: str | None = "application/json",
    timestamp: datetime | None = None,
    headers: Mapping[str, Any] | None = None,
) -> aio_pika.Message:
    """The copy of an event for one endpoint: the event id as its message id, the endpoint's id and our
    other headers beside it (never the broker's ``x-death``)."""
    return aio_pika.Message(
        body,
        content_type=content_type,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=event_id,
        timestamp=timestamp,
        headers={**(headers or {}), Header.ENDPOINT_ID: endpoint_id},
    )


async def send(publisher: Publisher, copy: aio_pika.Message, *, destination: str, delay_s: int = 0) -> None:
    """Publish ``copy`` to the queue ``destination`` after ``delay_s`` seconds, confirmed."""
    delay_s = min(max(delay_s, 0), topology.MAX_DELAY_S)
    exchange = topology.delay_entry(delay_s) if delay_s > 0 else topology.DELAY_DELIVERY
    await publisher.publish(
        copy, exchange=exchange, routing_key=topology.delay_routing_key(delay_s, destination)
    )


def endpoint_named(headers: Mapping[str, Any] | None) -> str | None:
    """The endpoint a message is meant for, when hookline addressed it to one."""
    value = (headers or {}).get(Header.ENDPOINT_ID)
    return value if isinstance(value, str) and value else None
