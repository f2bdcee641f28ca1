"""Who may do what on the broker: one RabbitMQ user per role, each limited to the names it uses.

RabbitMQ grants three permissions per vhost, each a regular expression over resource names: configure
(declare, delete), write (publish to an exchange; be the destination of a binding) and read (consume
from a queue; be the source of a binding). Publishing through the default exchange is a write on
``amq.default``. Topic permissions narrow writes to a topic exchange by routing key.

The matrix below is derived from :mod:`topology`'s names, so a renamed queue cannot drift out of it:

- the **ingest** owns the topology: it declares the core exchanges, queues and streams, provisions
  endpoints, appends to the endpoint change log, publishes accepted events and resends dead letters;
- a **dispatcher** consumes endpoint queues (and declares one deleted by hand), publishes retries,
  dead letters, telemetry and endpoint changes (disabling one), and follows the change and breaker logs;
  it cannot delete a stream nor publish an event;
- a **monitor** follows telemetry, dead letters, breakers and the change log, publishes breaker commands,
  alerts and endpoint notifications, holds the leader lock and repairs or removes endpoint queues;
- an **upstream** may only publish to ``events``, and with a tenant, only routing keys ``<tenant>.…``:
  it cannot append to the change log (register an endpoint), forge breaker commands or telemetry, read
  a stream, or declare anything.

Core names are declared by the ingest; a dispatcher or monitor without configure permission on them
finds them declared (:func:`topology.declare`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass

from hookline.shared.broker import topology

DEFAULT_EXCHANGE = "amq.default"  # what permissions call the default exchange ("")
NOTHING = "^$"


class Role(enum.StrEnum):
    INGEST = "ingest"
    DISPATCHER = "dispatcher"
    MONITOR = "monitor"


#: The user each role connects as, unless told otherwise.
USERS = {role: f"hookline-{role}" for role in Role}


@dataclass(frozen=True)
class Grant:
    """One user's permissions on one vhost: a regular expression per permission."""

    configure: str
    write: str
    read: str


@dataclass(frozen=True)
class TopicGrant:
    """A narrowing of writes to a topic exchange by routing key."""

    exchange: str
    write: str
    read: str


def names(exact: Iterable[str] = (), prefixes: Iterable[str] = ()) -> str:
    """An anchored expression matching exactly these names and any name starting with a prefix."""
    alternatives = [re.escape(name) for name in exact] + [re.escape(prefix) + ".*" for prefix in prefixes]
    return f"^(?:{'|'.join(alternatives)})$" if alternatives else NOTHING


_ENDPOINT_PREFIXES = (topology.ENDPOINT_QUEUE_PREFIX, topology.ROUTE_EXCHANGE_PREFIX)
_LANES = (*topology.lane_queues(), *topology.holding_queues())
_DELAY_LEVELS = tuple(topology.delay_level(level) for level in range(topology.DELAY_BITS))
# The sources an endpoint's provisioning binds from (events, retries).
_ENDPOINT_BINDING_SOURCES = (topology.EVENTS_EXCHANGE, topology.DELAY_DELIVERY)


def _core() -> tuple[str, ...]:
    return tuple(dict.fromkeys((*topology.core_exchanges(), *topology.core_queues())))


GRANTS: dict[Role, Grant] = {
    Role.INGEST: Grant(
        configure=names(_core(), _ENDPOINT_PREFIXES),
        write=names((*_core(), DEFAULT_EXCHANGE), _ENDPOINT_PREFIXES),
        read=names(_core(), _ENDPOINT_PREFIXES),
    ),
    Role.DISPATCHER: Grant(
        configure=names((), _ENDPOINT_PREFIXES),
        write=names(
            (
                DEFAULT_EXCHANGE,  # change-log records (a placement, a disable)
                topology.DEAD_LETTER_EXCHANGE,
                topology.TELEMETRY_EXCHANGE,
                topology.DELAY_DELIVERY,  # a copy handed on to an endpoint's address
                *_DELAY_LEVELS,
            ),
            _ENDPOINT_PREFIXES,
        ),
        read=names(
            (
                *_ENDPOINT_BINDING_SOURCES,
                topology.ENDPOINT_LOG,
                topology.BREAKER_LOG,
                topology.DELAY_UNROUTABLE,  # copies whose queue is gone: forwarded, or dead letters
                *_LANES,
            ),
            _ENDPOINT_PREFIXES,
        ),
    ),
    Role.MONITOR: Grant(
        configure=names((topology.MONITOR_LEADER_LOCK,), _ENDPOINT_PREFIXES),
        write=names(
            (
                DEFAULT_EXCHANGE,  # change-log records (disabling an endpoint)
                topology.DEAD_LETTER_EXCHANGE,  # declaring an endpoint queue names it (its repair)
                topology.CONTROL_EXCHANGE,
                topology.ALERTS_EXCHANGE,
                topology.EVENTS_EXCHANGE,  # endpoint notifications are events
                topology.DELAY_DELIVERY,  # ... addressed to the notifier
                topology.MONITOR_LEADER_LOCK,
                *_LANES,  # a tenant pattern no endpoint needs any more, unbound
            ),
            _ENDPOINT_PREFIXES,
        ),
        read=names(
            (
                *_ENDPOINT_BINDING_SOURCES,
                topology.ENDPOINT_LOG,
                topology.TELEMETRY_LOG,
                topology.DEAD_LETTER_STREAM,
                topology.BREAKER_LOG,
                topology.MONITOR_LEADER_LOCK,
            ),
            _ENDPOINT_PREFIXES,
        ),
    ),
}


def trusted_writer(user_id: str | None) -> bool:
    """Whether a record of tokens or quotas in the change log, or one of the audit trail, may come from
    this user: RabbitMQ vouches for a message's user_id, and only the ingest writes those records. A
    deployment with one user for everything (no broker-setup) is one trust domain anyway."""
    return user_id is not None and user_id not in (USERS[Role.DISPATCHER], USERS[Role.MONITOR])


def upstream_grant(tenant: str | None) -> tuple[Grant, TopicGrant | None]:
    """An upstream publishes events and nothing else; with a tenant, only that tenant's routing keys."""
    grant = Grant(configure=NOTHING, write=names((topology.EVENTS_EXCHANGE,)), read=NOTHING)
    if tenant is None:
        return grant, None
    prefix = re.escape(topology.event_routing_key(tenant, ""))
    return grant, TopicGrant(exchange=topology.EVENTS_EXCHANGE, write=f"^{prefix}", read=NOTHING)
