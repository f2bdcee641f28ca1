"""What the ingest's request handlers share, built once by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass

from aio_pika.abc import AbstractExchange, AbstractRobustChannel, AbstractRobustConnection
from fastapi import Request

from hookline.shared.deadletters import DeadLetterIndex
from hookline.shared.delivery import DeliveryClient
from hookline.shared.registry import ChangeLog, EndpointRegistry
from hookline.shared.sealing import Sealer
from hookline.shared.settings import IngestSettings
from hookline.shared.streams import StreamFollower


@dataclass
class IngestState:
    settings: IngestSettings
    connection: AbstractRobustConnection
    change_log: ChangeLog
    registry: EndpointRegistry
    # Confirmed publishes of events and dead letters; returns raise instead of passing for a confirm.
    publisher: AbstractRobustChannel
    events: AbstractExchange
    dead_letters: AbstractExchange
    # Declares, binds and drains endpoint queues: an error there closes this channel, not the publisher.
    admin: AbstractRobustChannel
    dead_letters_log: StreamFollower
    dead_letters_index: DeadLetterIndex
    client: DeliveryClient  # verification handshakes
    sealer: Sealer
    tenant_tokens: dict[str, str]  # token -> tenant

    def is_ready(self) -> bool:
        return not self.connection.is_closed and not self.publisher.is_closed


def ingest_state(request: Request) -> IngestState:
    state: IngestState = request.app.state.ingest
    return state
