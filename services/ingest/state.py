"""What the ingest's request handlers share, built once by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from hookline.ingest.deliverylog import DeliveryLog
from hookline.ingest.duplicates import Duplicates
from hookline.ingest.settings import IngestSettings
from hookline.shared.broker.amqp import Broker, Publisher
from hookline.shared.broker.capacity import CapacityReader
from hookline.shared.broker.isolation import Isolation
from hookline.shared.broker.streams import StreamFollower
from hookline.shared.broker.views import RowView
from hookline.shared.contracts.control import BreakerView
from hookline.shared.outbound.sealing import Sealer
from hookline.shared.runtime.supervision import Supervisor
from hookline.shared.runtime.tracing import Tracing
from hookline.shared.state.deadletterindex import DeadLetterIndex
from hookline.shared.state.registry import ChangeLog, EndpointRegistry

if TYPE_CHECKING:
    # Their modules import this one (audit and quotas for their routes' dependencies).
    from hookline.ingest.attempts import Attempts
    from hookline.ingest.audit import AuditTrail
    from hookline.ingest.bound import BoundPatterns
    from hookline.ingest.quotas import Quotas
    from hookline.ingest.replicas import Replicas


@dataclass
class IngestState:
    settings: IngestSettings
    broker: Broker  # admin operations (declare, bind, drain) take a channel of their own from it
    supervisor: Supervisor
    change_log: ChangeLog
    registry: EndpointRegistry
    # Confirmed publishes of events, dead letters and resends; returns raise instead of passing for a confirm.
    publisher: Publisher
    dead_letters_log: StreamFollower
    dead_letters_index: DeadLetterIndex
    attempts: Attempts  # the ingest's own attempts: verification handshakes, resends by hand
    capacity: CapacityReader  # the broker's file handles and alarms, before a queue of its own is declared
    delivery_log: DeliveryLog  # events and attempts, for "where is my event?"
    duplicates: Duplicates  # events accepted before, found in the delivery log
    breakers: BreakerView  # the breaker states in force, to explain why an event waits
    sealer: Sealer
    tracing: Tracing  # hookline.publish spans, exported when HOOKLINE_OTLP_ENDPOINT is set
    tenant_tokens: dict[
        str, str
    ]  # token -> tenant (HOOKLINE_TENANT_TOKENS; tokens as data: change_log.tenants)
    quotas: Quotas
    audit: RowView  # the audit trail's view (audit.py)
    trail: AuditTrail  # where the routes append to it
    replicas: Replicas  # the dispatchers, and how far each has read the change log
    bound: BoundPatterns  # tenant patterns bound on their lanes by this ingest, still needed
    isolation: Isolation  # a queue of its own for an endpoint many events are sent to again

    def problems(self) -> list[str]:
        # Blocked counts: a load balancer should send events to an ingest that can take them.
        return self.broker.problems() + self.supervisor.problems()


def ingest_state(request: Request) -> IngestState:
    state: IngestState = request.app.state.ingest
    return state


# The parts routes use most, one each (async: a sync dependency would take a threadpool hop).


async def _settings(request: Request) -> IngestSettings:
    return ingest_state(request).settings


async def _registry(request: Request) -> EndpointRegistry:
    return ingest_state(request).registry


async def _change_log(request: Request) -> ChangeLog:
    return ingest_state(request).change_log


async def _dead_letters(request: Request) -> DeadLetterIndex:
    return ingest_state(request).dead_letters_index


Settings = Annotated[IngestSettings, Depends(_settings)]
Registry = Annotated[EndpointRegistry, Depends(_registry)]
Changes = Annotated[ChangeLog, Depends(_change_log)]
DeadLetters = Annotated[DeadLetterIndex, Depends(_dead_letters)]
#: The whole state, for a route that orchestrates several of its parts (it hands each helper one).
State = Annotated[IngestState, Depends(ingest_state)]
