"""Every RabbitMQ name hookline uses, derived in one place, and the declarations that create them.

All queues are durable (quorum or stream) so the same code runs on RabbitMQ 3.10 through 4.x. A queue's
arguments come from one function each: redeclaring with different arguments is a channel error.

    events (topic) ──<tenant>.<pattern>──▶ hookline.lane.<n> (quorum; n = CRC-32 of the tenant mod LANES)
      │  ├─ "#" ──▶ hookline.events.log (stream: every accepted event, for replay)
      │  └─ alternate exchange ──▶ hookline.unrouted (only if the event log is missing)
    hookline.endpoint.<id>[.g<N>] (quorum): an endpoint's queue of its own, only while it needs one
      └─ bound to events for its patterns in place of its lane while routed directly (ordered: always)
    hookline.holding.<k> (quorum): isolated endpoints past the bound on queues of their own share these
    hookline.delay.27 … hookline.delay.00 (topic + quorum TTL queue of 2^NN s each)
      └─▶ hookline.delay.delivery (topic) ──"*"x28.<lane or endpoint queue>──▶ that queue
            └─ alternate exchange ──▶ hookline.delay.unroutable (the queue is gone: forwarded, or dead)
    hookline.dead (fanout) ──▶ hookline.dead-letters (stream: listable, redrivable)
    hookline.endpoints (stream): the endpoint change log every service replays and follows
    hookline.telemetry (fanout) ──▶ hookline.telemetry.log (stream, 25 h): attempt records, heartbeats
    hookline.control (fanout) ──▶ hookline.breakers (stream, 1 h): breaker commands and snapshots
    hookline.audit (stream, 400 days): who changed what through the API
    alerts (topic, <alert>.<state>): alerts firing and resolved, for whoever binds a queue

A registered endpoint costs the broker nothing of its own: its tenant's lane is bound once per distinct
``<tenant>.<pattern>`` of the tenant's endpoints (RabbitMQ queues a message once however many of a
queue's bindings match), and the dispatchers fan a lane message out to the tenant's matching endpoints.
An endpoint that needs isolation (its limits need one consumer, it is paused, disabled or unverified,
its breaker is open, it is slow or backlogged: :mod:`hookline.shared.broker.placement`) has a queue of its own,
to which the fan-out hands its copies; the leading monitor then binds that queue to ``events`` for the
endpoint's patterns and unbinds its lane for them (a direct route, ``Placement.direct``), so that its
events stop passing through the lane. An ``ordered`` endpoint's queue is bound so from the start
(``straight``): a lane is taken by every dispatcher, and two of them each handing on one of two events
of a subject could swap them. Messages meant for one endpoint (retries, replays, redrives,
notifications) carry its id (``x-hookline-endpoint-id``) and go to its *address*: its queue of its own
if it has one, else its lane. A message found in the wrong place is forwarded, never dropped. Past the
bound on queues of their own (``HOOKLINE_MAX_ENDPOINT_QUEUES``), an endpoint that needs isolation at run
time is *held* instead: its address is one of a few shared holding lanes (by CRC-32 of its id), apart
from the healthy lanes, where its copies go out with per-endpoint caps, or wait out an open breaker in
the delay queues.

A queue's arguments are fixed when it is declared, so an endpoint whose options need other arguments
(a rate limit added or removed: single active consumer) gets a queue of the next generation,
``hookline.endpoint.<id>.g<N>``; the queues it left (``retired_queues``) are drained into its address.

Delays (reference/rabbitmq-techniques.md §1): a retry is published to the level of the highest set bit
of its delay in seconds, with a routing key of the 28 bits, most significant first, then the name of the
queue it is addressed to. Each level either holds the message for 2^NN s (bit set) or passes it down
(bit clear); every level queue has one TTL, so a message never waits behind a later-expiring one.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import shlex
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractQueue

from hookline.shared.broker.amqp import BROKER_ERRORS, CALL_TIMEOUT_S, Broker
from hookline.shared.contracts.models import StoredEndpoint

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
MB = 1_000_000
GB = 1_000_000_000
# Snapshots every few seconds and commands: an hour of them is what a follower needs; the cap holds
# even with tens of thousands of endpoints.
BREAKER_LOG_MAX_BYTES = 200 * MB
EVENT_LOG = "hookline.events.log"
TELEMETRY_EXCHANGE = "hookline.telemetry"
TELEMETRY_LOG = "hookline.telemetry.log"
# 24 h of window plus an hour of margin; the byte cap (Retention) bounds the disk at very high rates
# (the rebuilt window is then shorter than 24 h).
TELEMETRY_MAX_AGE = "25h"
CONTROL_EXCHANGE = "hookline.control"
BREAKER_LOG = "hookline.breakers"
AUDIT_LOG = "hookline.audit"  # who changed what (services/ingest/audit.py)
AUDIT_MAX_AGE_S = 400 * 86_400
AUDIT_MAX_BYTES = 1 * GB
ALERTS_EXCHANGE = "alerts"
# Held (declared exclusive) by the health monitor that leads; the broker deletes it with its connection.
MONITOR_LEADER_LOCK = "hookline.monitor.leader"

#: How long a queue found missing stays so before hookline declares it again. RabbitMQ tells a deleted
#: quorum queue's consumers (basic.cancel) a moment after the delete; a queue declared again under the
#: same name before that takes the old consumers back: the broker counts them and hands them messages
#: that their channels never pass on. Measured on RabbitMQ 3.10: a queue declared again at once kept a
#: consumer for good that held a message unacked and undelivered; 50 ms later the cancel had come.
REDECLARE_AFTER_S = 1.0

DELAY_BITS = 28
MAX_DELAY_S = 2**DELAY_BITS - 1
DELAY_DELIVERY = "hookline.delay.delivery"
DELAY_UNROUTABLE = "hookline.delay.unroutable"


def delay_level(level: int) -> str:
    return f"hookline.delay.{level:02d}"


def delay_routing_key(delay_s: int, destination: str) -> str:
    """28 words of bits of ``delay_s``, most significant first, then the destination's name."""
    if not 0 <= delay_s <= MAX_DELAY_S:
        raise ValueError(f"a delay must be between 0 and {MAX_DELAY_S} s")
    return ".".join(format(delay_s, f"0{DELAY_BITS}b")) + "." + destination


def delay_entry(delay_s: int) -> str:
    """The exchange a message with this delay is published to: the level of its highest set bit."""
    return delay_level(max(delay_s.bit_length() - 1, 0))


def delay_delivery_binding(destination: str) -> str:
    # Exactly 28 bit words: "#.<name>" would also match any name that ends with ".<name>".
    return "*." * DELAY_BITS + destination


def delay_destination(routing_key: str) -> str:
    """The destination named by a delayed message's routing key (its part after the 28 bits)."""
    return routing_key.split(".", DELAY_BITS)[-1]


#: Names of the version before lanes: an endpoint's fanout route exchange and its alternate. An ingest
#: of this version removes them (:func:`unroute_legacy`); retries still addressed to them are unroutable
#: and forwarded.
ROUTE_EXCHANGE_PREFIX = "hookline.route."
LANE_PREFIX = "hookline.lane."
#: Lanes, the shared queues events reach endpoints through: a tenant's endpoints share one, so an event
#: is one queue write whatever the number of its endpoints, and one lane's head-of-line is shared only by
#: the tenants in it (docs/decisions.md, "Lanes"). Changing it moves tenants between lanes: not done
#: without a migration, so it is a constant every service agrees on.
LANES = 16


def lane_queue(lane: int) -> str:
    return f"{LANE_PREFIX}{lane:02d}"


def lane_queues() -> list[str]:
    return [lane_queue(lane) for lane in range(LANES)]


def lane_of(tenant: str) -> str:
    """The lane a tenant's events go through."""
    return lane_queue(zlib.crc32(tenant.encode()) % LANES)


HOLDING_PREFIX = "hookline.holding."
#: Holding lanes: shared by the endpoints isolated past the bound on queues of their own, so that a
#: thousand failing or slow endpoints cost four queues, never a place in a healthy lane.
HOLDING_LANES = 4


def holding_queue(lane: int) -> str:
    return f"{HOLDING_PREFIX}{lane}"


def holding_queues() -> list[str]:
    return [holding_queue(lane) for lane in range(HOLDING_LANES)]


def holding_of(endpoint_id: str) -> str:
    """The holding lane an endpoint held past the bound goes through."""
    return holding_queue(zlib.crc32(endpoint_id.encode()) % HOLDING_LANES)


def is_holding(name: str | None) -> bool:
    return name is not None and name.startswith(HOLDING_PREFIX)


def endpoint_queue(endpoint_id: str, generation: int = 0) -> str:
    name = ENDPOINT_QUEUE_PREFIX + endpoint_id
    return name if generation == 0 else f"{name}.g{generation}"


def own_queue(endpoint: StoredEndpoint) -> str:
    """The endpoint's queue of its own, of its current generation (it exists only while isolated)."""
    return endpoint_queue(endpoint.id, endpoint.queue_generation)


def address(endpoint: StoredEndpoint, *, isolated: bool, held: bool = False) -> str:
    """Where a message meant for this endpoint alone goes: its queue of its own (its holding lane when it
    is held past the bound), else its lane."""
    if held:
        return holding_of(endpoint.id)
    return own_queue(endpoint) if isolated else lane_of(endpoint.tenant)


def route_exchange(endpoint_id: str) -> str:
    return ROUTE_EXCHANGE_PREFIX + endpoint_id


def route_alternate(endpoint_id: str) -> str:
    return route_exchange(endpoint_id) + ".alt"


def endpoint_of(name: str) -> str | None:
    """The endpoint a queue (or a legacy route exchange, or a retry destination) belongs to; None for a
    lane or any other name."""
    for prefix in (ENDPOINT_QUEUE_PREFIX, ROUTE_EXCHANGE_PREFIX):
        if name.startswith(prefix):
            return name.removeprefix(prefix).split(".", 1)[0] or None
    return None


def is_lane(name: str | None) -> bool:
    return name is not None and name.startswith(LANE_PREFIX)


def binding_keys(tenant: str, patterns: Iterable[str]) -> set[str]:
    """The routing patterns that bind a lane to ``events`` for a tenant's patterns: ``<tenant>.<pattern>``."""
    return {f"{tenant}.{pattern}" for pattern in patterns}


def event_routing_key(tenant: str, event_type: str) -> str:
    return f"{tenant}.{event_type}"


def published_as(routing_key: str | None, event: dict[str, object]) -> bool:
    """Whether a record of the event log was published under its body's own tenant and type: an
    upstream limited to its tenant's routing keys could otherwise claim another tenant in the body."""
    tenant, event_type = event.get("tenant"), event.get("type")
    return (
        isinstance(tenant, str)
        and isinstance(event_type, str)
        and routing_key == event_routing_key(tenant, event_type)
    )


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


@dataclass(frozen=True)
class Retention:
    """What each stream keeps, by age and by bytes, whichever cuts first; the byte caps bound the disk
    the streams can take (:attr:`disk_budget_bytes`, README: sizing the broker's disk). They are fixed
    when a stream is declared; a policy changes them later (:func:`retention_policy`)."""

    event_log_max_age_s: int = 604_800
    event_log_max_bytes: int = 20 * GB
    dead_letter_max_bytes: int = 5 * GB
    telemetry_max_bytes: int = 4 * GB

    def arguments(self) -> dict[str, dict[str, Any]]:
        """Each capped stream's declaration arguments."""
        return {
            EVENT_LOG: _stream_arguments(f"{self.event_log_max_age_s}s", self.event_log_max_bytes),
            DEAD_LETTER_STREAM: _stream_arguments(DEAD_LETTER_MAX_AGE, self.dead_letter_max_bytes),
            TELEMETRY_LOG: _stream_arguments(
                TELEMETRY_MAX_AGE, self.telemetry_max_bytes, segment_bytes=50 * MB
            ),
            BREAKER_LOG: _stream_arguments("1h", BREAKER_LOG_MAX_BYTES, segment_bytes=5 * MB),
            AUDIT_LOG: _stream_arguments(f"{AUDIT_MAX_AGE_S}s", AUDIT_MAX_BYTES),
        }

    @property
    def disk_budget_bytes(self) -> int:
        """The most the capped streams hold: each cap plus the segment being written, which a cap never
        cuts (the endpoint log, the one uncapped stream, grows by about 1 KB per endpoint change)."""
        return sum(
            arguments["x-max-length-bytes"] + arguments["x-stream-max-segment-size-bytes"]
            for arguments in self.arguments().values()
        )


def _stream_arguments(max_age: str, max_bytes: int, *, segment_bytes: int | None = None) -> dict[str, Any]:
    # A cap cuts whole segments: about 20 of them per cap keeps the cut fine-grained (RabbitMQ's default
    # segment is 500 MB, coarse for a small cap).
    segment_bytes = segment_bytes or max(MB, min(500 * MB, max_bytes // 20))
    return {
        "x-queue-type": "stream",
        "x-max-age": max_age,
        "x-max-length-bytes": max_bytes,
        "x-stream-max-segment-size-bytes": segment_bytes,
    }


def retention_policy(stream: str, arguments: dict[str, Any], *, vhost: str) -> str:
    """The ``rabbitmqctl`` command that gives an existing stream these caps (policies apply to streams
    that exist; declared arguments cannot change)."""
    definition = {key.removeprefix("x-"): value for key, value in arguments.items() if key != "x-queue-type"}
    pattern = "^" + re.escape(stream) + "$"
    return (
        f"rabbitmqctl set_policy -p {shlex.quote(vhost)} --apply-to queues "
        f"{shlex.quote(stream + '-retention')} {shlex.quote(pattern)} {shlex.quote(json.dumps(definition))}"
    )


async def declare(broker: Broker, retention: Retention, *, timeout_s: float = 60.0) -> None:
    """Declare everything every service relies on, on a channel of its own (idempotent).

    A broker that is restarting (or refuses for a moment) is asked again until ``timeout_s``. A queue
    that exists with other arguments stops the service at start with the broker's words; a stream that
    exists with other retention (created by an earlier version, or with other settings) is used as it
    is, with a warning naming the policy that would give it these caps.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            for stream, arguments in retention.arguments().items():
                await _declare_stream(broker, stream, arguments)
            async with broker.channel() as channel:
                await _declare_core(channel)
            return
        except aio_pika.exceptions.ChannelPreconditionFailed as exc:
            structlog.get_logger(__name__).error("topology_mismatch", detail=str(exc))
            raise SystemExit(1) from None
        except aiormq.exceptions.ChannelAccessRefused:
            # A role that does not own the topology (shared/broker/permissions.py: only the ingest may
            # declare it) finds it declared, or waits for the ingest to declare it.
            missing = await _missing_core(broker)
            if missing is None:
                return
            if time.monotonic() > deadline:
                raise TopologyMissingError(missing) from None
            structlog.get_logger(__name__).warning("topology_not_declared_yet", missing=missing)
            await asyncio.sleep(1.0)
        except BROKER_ERRORS as exc:
            if time.monotonic() > deadline:
                raise
            structlog.get_logger(__name__).warning("topology_declare_retry", error=type(exc).__name__)
            await asyncio.sleep(1.0)


class TopologyMissingError(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"{name} is not declared, and this user may not declare it (start the ingest first)")


async def _missing_core(broker: Broker) -> str | None:
    """The first core exchange or queue that does not exist (None when all do), asked passively: a
    passive declare needs no permission."""
    async with broker.channel() as channel:
        for exchange in core_exchanges():
            try:
                await channel.declare_exchange(exchange, passive=True, timeout=CALL_TIMEOUT_S)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                return exchange
        for queue in core_queues():
            try:
                await channel.declare_queue(queue, passive=True, timeout=CALL_TIMEOUT_S)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                return queue
    return None


async def _declare_stream(broker: Broker, stream: str, arguments: dict[str, Any]) -> None:
    try:
        async with broker.channel() as channel:
            await channel.declare_queue(stream, durable=True, arguments=arguments)
    except aio_pika.exceptions.ChannelPreconditionFailed as exc:
        structlog.get_logger(__name__).warning(
            "stream_retention_differs",
            stream=stream,
            detail=str(exc)[:300],
            wanted={key: value for key, value in arguments.items() if key != "x-queue-type"},
            policy=retention_policy(stream, arguments, vhost=broker.vhost),
        )


async def _declare_core(channel: AbstractChannel) -> None:
    """Every exchange, queue and binding every service relies on, the capped streams aside."""
    unrouted = await channel.declare_exchange(UNROUTED, aio_pika.ExchangeType.FANOUT, durable=True)
    unrouted_queue = await channel.declare_queue(
        UNROUTED,
        durable=True,
        arguments={"x-queue-type": "quorum", "x-max-length": UNROUTED_MAX_LENGTH, "x-overflow": "drop-head"},
    )
    await unrouted_queue.bind(unrouted)
    events = await events_exchange(channel)
    event_log = await _stream(channel, EVENT_LOG)
    await event_log.bind(events, routing_key="#")

    dead = await channel.declare_exchange(DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
    dead_letters = await _stream(channel, DEAD_LETTER_STREAM)
    await dead_letters.bind(dead)
    await endpoint_log(channel)
    await _declare_delays(channel)
    for name in (*lane_queues(), *holding_queues()):
        lane = await channel.declare_queue(
            name, durable=True, arguments=endpoint_queue_arguments(single_consumer=False)
        )
        await lane.bind(DELAY_DELIVERY, routing_key=delay_delivery_binding(name))
    telemetry = await channel.declare_exchange(TELEMETRY_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
    await (await _stream(channel, TELEMETRY_LOG)).bind(telemetry)
    control = await channel.declare_exchange(CONTROL_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True)
    await (await _stream(channel, BREAKER_LOG)).bind(control)
    await channel.declare_exchange(ALERTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)


async def _stream(channel: AbstractChannel, name: str) -> AbstractQueue:
    # Declared (with its retention, or found with another) by declare() just before.
    return await channel.declare_queue(name, passive=True, timeout=CALL_TIMEOUT_S)


async def _declare_delays(channel: AbstractChannel) -> None:
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


async def endpoint_log(channel: AbstractChannel) -> AbstractQueue:
    # No retention limit: the log is the only copy of the endpoint definitions.
    return await channel.declare_queue(ENDPOINT_LOG, durable=True, arguments={"x-queue-type": "stream"})


async def declare_own_queue(
    channel: AbstractChannel, endpoint: StoredEndpoint, generation: int | None = None
) -> AbstractQueue:
    """Declare (create if missing) the endpoint's queue of its own of ``generation`` (default: its
    current one), and bind it for the retries addressed to it; a ``straight`` endpoint's current one
    also to ``events`` for its patterns (wherever it is declared: a queue lost and declared again gets
    its events again)."""
    generation = endpoint.queue_generation if generation is None else generation
    name = endpoint_queue(endpoint.id, generation)
    queue = await channel.declare_queue(
        name, durable=True, arguments=endpoint_queue_arguments(single_consumer=endpoint.single_consumer)
    )
    await queue.bind(DELAY_DELIVERY, routing_key=delay_delivery_binding(name))
    if endpoint.straight and generation == endpoint.queue_generation:
        await bind_direct(channel, name, endpoint.tenant, endpoint.event_types)
    return queue


async def provision(channel: AbstractChannel, endpoint: StoredEndpoint, *, isolated: bool) -> None:
    """What the endpoint needs, declared and bound (idempotent): its patterns on its tenant's lane, and
    its queue of its own when it is ``isolated`` (declared before anything is handed to it)."""
    if isolated:
        await declare_own_queue(channel, endpoint)
    if endpoint.laned:
        await bind_patterns(channel, endpoint.tenant, endpoint.event_types)


async def bind_patterns(channel: AbstractChannel, tenant: str, patterns: Iterable[str]) -> None:
    lane = await channel.get_queue(lane_of(tenant), ensure=False)
    for key in sorted(binding_keys(tenant, patterns)):
        await lane.bind(EVENTS_EXCHANGE, routing_key=key)


async def unbind_pattern(channel: AbstractChannel, tenant: str, pattern: str) -> None:
    """A tenant pattern no endpoint needs any more (the leading monitor decides that)."""
    lane = await channel.get_queue(lane_of(tenant), ensure=False)
    await lane.unbind(EVENTS_EXCHANGE, routing_key=f"{tenant}.{pattern}")


async def bind_direct(channel: AbstractChannel, queue: str, tenant: str, patterns: Iterable[str]) -> None:
    """An isolated endpoint's queue of its own bound to ``events`` for its tenant's ``patterns``: its
    events reach it without passing through its lane (placed so by the leading monitor)."""
    own = await channel.get_queue(queue, ensure=False)
    for key in sorted(binding_keys(tenant, patterns)):
        await own.bind(EVENTS_EXCHANGE, routing_key=key)


async def unbind_direct(channel: AbstractChannel, queue: str, tenant: str, patterns: Iterable[str]) -> None:
    """The bindings :func:`bind_direct` made, removed (none left when the queue is gone already)."""
    own = await channel.get_queue(queue, ensure=False)
    try:
        for key in sorted(binding_keys(tenant, patterns)):
            await own.unbind(EVENTS_EXCHANGE, routing_key=key)
    except aio_pika.exceptions.ChannelNotFoundEntity:
        pass  # the queue is gone: so are its bindings


async def unroute_legacy(channel: AbstractChannel, endpoint: StoredEndpoint) -> None:
    """The route exchanges (and, older still, the direct bindings) of an endpoint of a version before
    lanes: deleting the exchanges removes every binding to them. Its queue stays until it is drained."""
    await channel.exchange_delete(route_exchange(endpoint.id))
    await channel.exchange_delete(route_alternate(endpoint.id))
    queue = await channel.get_queue(endpoint_queue(endpoint.id), ensure=False)
    try:
        for key in sorted(binding_keys(endpoint.tenant, endpoint.event_types)):
            await queue.unbind(EVENTS_EXCHANGE, routing_key=key)
        await queue.unbind(DELAY_DELIVERY, routing_key=delay_delivery_binding(queue.name))
    except aio_pika.exceptions.ChannelNotFoundEntity:
        pass  # its queue is gone already (drained and removed): so are its bindings


def core_exchanges() -> list[str]:
    """The exchanges every service relies on (what :func:`declare` creates)."""
    return [
        EVENTS_EXCHANGE,
        UNROUTED,
        DEAD_LETTER_EXCHANGE,
        TELEMETRY_EXCHANGE,
        CONTROL_EXCHANGE,
        ALERTS_EXCHANGE,
        DELAY_DELIVERY,
        DELAY_UNROUTABLE,
        *(delay_level(level) for level in range(DELAY_BITS)),
    ]


def core_queues() -> list[str]:
    """The queues and streams every service relies on (what :func:`declare` creates)."""
    return [
        UNROUTED,
        EVENT_LOG,
        DEAD_LETTER_STREAM,
        ENDPOINT_LOG,
        TELEMETRY_LOG,
        BREAKER_LOG,
        AUDIT_LOG,
        DELAY_UNROUTABLE,
        *(delay_level(level) for level in range(DELAY_BITS)),
        *lane_queues(),
        *holding_queues(),
    ]


def endpoint_queues(endpoint: StoredEndpoint) -> list[str]:
    """Every queue of its own the endpoint may have messages in: the current one (if it is isolated, or
    was) and those it left."""
    return [endpoint_queue(endpoint.id, endpoint.queue_generation), *endpoint.retired_queues]


def patterns_overlap(first: str, second: str) -> bool:
    """Whether some routing key matches both topic patterns (``*`` one word, ``#`` zero or more)."""
    a, b = first.split("."), second.split(".")

    @functools.cache
    def rest(i: int, j: int) -> bool:
        """Whether ``a[i:]`` and ``b[j:]`` match some words alike. A ``#`` either matches no more words,
        or matches the next word the other pattern does (when both are ``#``, one of them ends first)."""
        if i < len(a) and a[i] == "#":
            return rest(i + 1, j) or (j < len(b) and rest(i, j + 1))
        if j < len(b) and b[j] == "#":
            return rest(i, j + 1) or (i < len(a) and rest(i + 1, j))
        if i == len(a) or j == len(b):
            return i == len(a) and j == len(b)
        return (a[i] == b[j] or "*" in (a[i], b[j])) and rest(i + 1, j + 1)

    return rest(0, 0)


@functools.lru_cache(maxsize=65_536)
def topic_matches(pattern: str, routing_key: str) -> bool:
    """RabbitMQ topic matching: ``*`` is exactly one word, ``#`` zero or more (remembered: a direct copy
    is checked against its endpoint's patterns each time)."""
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
