"""Every RabbitMQ name hookline uses, derived in one place, and the declarations that create them.

All queues are durable (quorum or stream) so the same code runs on RabbitMQ 3.10 through 4.x. A queue's
arguments come from one function each: redeclaring with different arguments is a channel error.

    events (topic) ──<tenant>.<pattern>──▶ hookline.endpoint.<id> (quorum, one per endpoint)
      │  ├─ "#" ──▶ hookline.events.log (stream: every accepted event, for replay)
      │  └─ alternate exchange ──▶ hookline.unrouted (only if the event log is missing)
    hookline.delay.27 … hookline.delay.00 (topic + quorum TTL queue of 2^NN s each)
      └─▶ hookline.delay.delivery (topic) ──"*"x28.<queue>──▶ hookline.endpoint.<id>
            └─ alternate exchange ──▶ hookline.delay.unroutable (the endpoint queue is gone)
    hookline.dead (fanout) ──▶ hookline.dead-letters (stream: listable, redrivable)
    hookline.endpoints (stream): the endpoint change log every service replays and follows
    hookline.telemetry (fanout) ──▶ hookline.telemetry.log (stream, 25 h): attempt records, heartbeats
    hookline.control (fanout) ──▶ hookline.breakers (stream, 1 h): breaker commands and snapshots
    alerts (topic, <alert>.<state>): alerts firing and resolved, for whoever binds a queue

Delays (reference/rabbitmq-techniques.md §1): a retry is published to the level of the highest set bit
of its delay in seconds, with a routing key of the 28 bits, most significant first, then the endpoint
queue's name. Each level either holds the message for 2^NN s (bit set) or passes it down (bit clear);
every level queue has one TTL, so a message never waits behind a later-expiring one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import aio_pika
import structlog
from aio_pika.abc import (
    AbstractChannel,
    AbstractExchange,
    AbstractRobustChannel,
    AbstractRobustConnection,
    AbstractRobustQueue,
)

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
EVENT_LOG = "hookline.events.log"
TELEMETRY_EXCHANGE = "hookline.telemetry"
TELEMETRY_LOG = "hookline.telemetry.log"
# 24 h of window plus an hour of margin; the byte cap bounds the disk at very high rates (the rebuilt
# window is then shorter than 24 h).
TELEMETRY_MAX_AGE = "25h"
TELEMETRY_MAX_BYTES = 4_000_000_000
CONTROL_EXCHANGE = "hookline.control"
BREAKER_LOG = "hookline.breakers"
ALERTS_EXCHANGE = "alerts"

DELAY_BITS = 28
MAX_DELAY_S = 2**DELAY_BITS - 1
DELAY_DELIVERY = "hookline.delay.delivery"
DELAY_UNROUTABLE = "hookline.delay.unroutable"


def delay_level(level: int) -> str:
    return f"hookline.delay.{level:02d}"


def delay_routing_key(delay_s: int, queue: str) -> str:
    """28 words of bits of ``delay_s``, most significant first, then the destination queue's name."""
    if not 0 <= delay_s <= MAX_DELAY_S:
        raise ValueError(f"a delay must be between 0 and {MAX_DELAY_S} s")
    return ".".join(format(delay_s, f"0{DELAY_BITS}b")) + "." + queue


def delay_entry(delay_s: int) -> str:
    """The exchange a message with this delay is published to: the level of its highest set bit."""
    return delay_level(max(delay_s.bit_length() - 1, 0))


def delay_delivery_binding(queue: str) -> str:
    # Exactly 28 bit words: "#.<queue>" would also match any queue whose name ends with ".<queue>".
    return "*." * DELAY_BITS + queue


def endpoint_queue(endpoint_id: str) -> str:
    return ENDPOINT_QUEUE_PREFIX + endpoint_id


def binding_keys(tenant: str, patterns: Iterable[str]) -> set[str]:
    """The routing patterns that bind an endpoint's queue to ``events``: ``<tenant>.<pattern>``."""
    return {f"{tenant}.{pattern}" for pattern in patterns}


def event_routing_key(tenant: str, event_type: str) -> str:
    return f"{tenant}.{event_type}"


def endpoint_queue_arguments(*, single_consumer: bool) -> dict[str, Any]:
    arguments: dict[str, Any] = {
        "x-queue-type": "quorum",
        "x-delivery-limit": ENDPOINT_DELIVERY_LIMIT,
        "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
        # at-least-once dead-lettering needs reject-publish; the queue has no length limit.
        "x-dead-letter-strategy": "at-least-once",
        "x-overflow": "reject-publish",
    }
    if single_consumer:
        # Ordered and limited endpoints: one dispatcher at a time, the others stand by (failover).
        arguments["x-single-active-consumer"] = True
    return arguments


async def declare(connection: AbstractRobustConnection, *, event_log_max_age_s: int) -> None:
    """Declare everything every service relies on, on a channel of its own (idempotent).

    Something that exists with other arguments (say, the event log declared with another retention;
    change that with a policy instead) stops the service at start with the broker's words.
    """
    channel = await connection.channel()
    try:
        await declare_core(channel, event_log_max_age_s=event_log_max_age_s)
    except aio_pika.exceptions.ChannelPreconditionFailed as exc:
        structlog.get_logger(__name__).error("topology_mismatch", detail=str(exc))
        raise SystemExit(1) from None
    finally:
        if not channel.is_closed:
            await channel.close()


async def declare_core(channel: AbstractRobustChannel, *, event_log_max_age_s: int) -> None:
    unrouted = await channel.declare_exchange(UNROUTED, aio_pika.ExchangeType.FANOUT, durable=True)
    unrouted_queue = await channel.declare_queue(
        UNROUTED,
        durable=True,
        arguments={"x-queue-type": "quorum", "x-max-length": UNROUTED_MAX_LENGTH, "x-overflow": "drop-head"},
    )
    await unrouted_queue.bind(unrouted)
    events = await events_exchange(channel)
    event_log = await channel.declare_queue(
        EVENT_LOG,
        durable=True,
        arguments={"x-queue-type": "stream", "x-max-age": f"{event_log_max_age_s}s"},
    )
    await event_log.bind(events, routing_key="#")

    dead = await channel.declare_exchange(DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
    dead_letters = await channel.declare_queue(
        DEAD_LETTER_STREAM,
        durable=True,
        arguments={"x-queue-type": "stream", "x-max-age": DEAD_LETTER_MAX_AGE},
    )
    await dead_letters.bind(dead)
    await endpoint_log(channel)
    await _declare_delays(channel)
    await _declare_health(channel)


async def _declare_health(channel: AbstractRobustChannel) -> None:
    telemetry = await channel.declare_exchange(TELEMETRY_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
    telemetry_log = await channel.declare_queue(
        TELEMETRY_LOG,
        durable=True,
        arguments={
            "x-queue-type": "stream",
            "x-max-age": TELEMETRY_MAX_AGE,
            "x-max-length-bytes": TELEMETRY_MAX_BYTES,
            "x-stream-max-segment-size-bytes": 50_000_000,
        },
    )
    await telemetry_log.bind(telemetry)
    control = await channel.declare_exchange(CONTROL_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
    breakers = await channel.declare_queue(
        BREAKER_LOG,
        durable=True,
        arguments={"x-queue-type": "stream", "x-max-age": "1h", "x-stream-max-segment-size-bytes": 5_000_000},
    )
    await breakers.bind(control)
    await channel.declare_exchange(ALERTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)


async def _declare_delays(channel: AbstractRobustChannel) -> None:
    unroutable = await channel.declare_exchange(DELAY_UNROUTABLE, aio_pika.ExchangeType.FANOUT, durable=True)
    unroutable_queue = await channel.declare_queue(
        DELAY_UNROUTABLE, durable=True, arguments={"x-queue-type": "quorum"}
    )
    await unroutable_queue.bind(unroutable)
    delivery = await delay_delivery_exchange(channel)
    below: AbstractExchange = delivery
    for level in range(DELAY_BITS):
        exchange = await channel.declare_exchange(
            delay_level(level), aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(
            delay_level(level),
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-message-ttl": 2**level * 1000,
                "x-dead-letter-exchange": below.name,
                "x-dead-letter-strategy": "at-least-once",
                "x-overflow": "reject-publish",
            },
        )
        higher_bits = "*." * (DELAY_BITS - 1 - level)
        await queue.bind(exchange, routing_key=higher_bits + "1.#")
        await below.bind(exchange, routing_key=higher_bits + "0.#")
        below = exchange


async def delay_delivery_exchange(channel: AbstractChannel) -> AbstractExchange:
    return await channel.declare_exchange(
        DELAY_DELIVERY,
        aio_pika.ExchangeType.TOPIC,
        durable=True,
        arguments={"alternate-exchange": DELAY_UNROUTABLE},
    )


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
    channel: AbstractRobustChannel, endpoint_id: str, *, single_consumer: bool, robust: bool = True
) -> AbstractRobustQueue:
    return await channel.declare_queue(
        endpoint_queue(endpoint_id),
        durable=True,
        arguments=endpoint_queue_arguments(single_consumer=single_consumer),
        robust=robust,
    )


def topic_matches(pattern: str, routing_key: str) -> bool:
    """RabbitMQ topic matching: ``*`` is exactly one word, ``#`` zero or more (used by replay)."""
    words = routing_key.split(".")
    parts = pattern.split(".")

    # matched[i][j]: the first i pattern parts match the first j words
    matched = [[False] * (len(words) + 1) for _ in range(len(parts) + 1)]
    matched[0][0] = True
    for i, part in enumerate(parts, start=1):
        for j in range(len(words) + 1):
            if part == "#":
                matched[i][j] = matched[i - 1][j] or (j > 0 and matched[i][j - 1])
            elif j > 0:
                matched[i][j] = matched[i - 1][j - 1] and (part in ("*", words[j - 1]))
    return matched[len(parts)][len(words)]
