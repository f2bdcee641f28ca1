"""Every RabbitMQ name hookline uses, derived in one place, and the declarations that create them.

All queues are durable (quorum or stream) so the same code runs on RabbitMQ 3.10 through 4.x. A queue's
arguments come from one function each: redeclaring with different arguments is a channel error.

    events (topic) ──<tenant>.<pattern>──▶ hookline.endpoint.<id> (quorum, one per endpoint)
      │  └─ alternate exchange ──▶ hookline.unrouted (events no endpoint subscribes to)
    hookline.dead (fanout) ──▶ hookline.dead-letters (stream: listable, redrivable)
    hookline.endpoints (stream): the endpoint change log every service replays and follows
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractRobustChannel, AbstractRobustQueue

EVENTS_EXCHANGE = "events"
UNROUTED = "hookline.unrouted"
DEAD_LETTER_EXCHANGE = "hookline.dead"
DEAD_LETTER_STREAM = "hookline.dead-letters"
ENDPOINT_LOG = "hookline.endpoints"
ENDPOINT_QUEUE_PREFIX = "hookline.endpoint."

# A message redelivered this many times (crashes, connection losses, requeues) is poison: the broker
# dead-letters it instead of looping. Explicit and positive: -1 means "drop everything" on 3.x.
ENDPOINT_DELIVERY_LIMIT = 50
UNROUTED_MAX_LENGTH = 100_000
DEAD_LETTER_MAX_AGE = "30D"


def endpoint_queue(endpoint_id: str) -> str:
    return ENDPOINT_QUEUE_PREFIX + endpoint_id


def binding_keys(tenant: str, patterns: Iterable[str]) -> set[str]:
    """The routing patterns that bind an endpoint's queue to ``events``: ``<tenant>.<pattern>``."""
    return {f"{tenant}.{pattern}" for pattern in patterns}


def event_routing_key(tenant: str, event_type: str) -> str:
    return f"{tenant}.{event_type}"


def endpoint_queue_arguments(*, ordered: bool) -> dict[str, Any]:
    arguments: dict[str, Any] = {
        "x-queue-type": "quorum",
        "x-delivery-limit": ENDPOINT_DELIVERY_LIMIT,
        "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
        # at-least-once dead-lettering needs reject-publish; the queue has no length limit.
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }
    if ordered:
        arguments["x-single-active-consumer"] = True
    return arguments


async def declare_core(channel: AbstractRobustChannel) -> None:
    """Declare the exchanges and queues every service relies on (idempotent)."""
    unrouted = await channel.declare_exchange(UNROUTED, aio_pika.ExchangeType.FANOUT, durable=True)
    unrouted_queue = await channel.declare_queue(
        UNROUTED,
        durable=True,
        arguments={"x-queue-type": "quorum", "x-max-length": UNROUTED_MAX_LENGTH, "x-overflow": "drop-head"},
    )
    await unrouted_queue.bind(unrouted)
    await events_exchange(channel)

    dead = await channel.declare_exchange(DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
    dead_letters = await channel.declare_queue(
        DEAD_LETTER_STREAM,
        durable=True,
        arguments={"x-queue-type": "stream", "x-max-age": DEAD_LETTER_MAX_AGE},
    )
    await dead_letters.bind(dead)
    await endpoint_log(channel)


async def events_exchange(channel: AbstractChannel) -> AbstractExchange:
    return await channel.declare_exchange(
        EVENTS_EXCHANGE,
        aio_pika.ExchangeType.TOPIC,
        durable=True,
        arguments={"alternate-exchange": UNROUTED},
    )


async def dead_letter_exchange(channel: AbstractChannel) -> AbstractExchange:
    return await channel.declare_exchange(DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)


async def endpoint_log(channel: AbstractRobustChannel) -> AbstractRobustQueue:
    # No retention limit: the log is the only copy of the endpoint definitions.
    return await channel.declare_queue(ENDPOINT_LOG, durable=True, arguments={"x-queue-type": "stream"})


async def endpoint_queue_declare(
    channel: AbstractRobustChannel, endpoint_id: str, *, ordered: bool, robust: bool = True
) -> AbstractRobustQueue:
    return await channel.declare_queue(
        endpoint_queue(endpoint_id),
        durable=True,
        arguments=endpoint_queue_arguments(ordered=ordered),
        robust=robust,
    )
