"""Putting events back on their way to one endpoint (redrive, replay): to its address
(:mod:`hookline.shared.contracts.addressing`), same event id, fresh attempt budget."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from hookline.shared.broker.amqp import Publisher
from hookline.shared.broker.isolation import Isolation
from hookline.shared.broker.placement import Reason
from hookline.shared.contracts import addressing
from hookline.shared.contracts.headers import Header
from hookline.shared.state.registry import EndpointRegistry

#: Confirms awaited together; enough to keep the broker busy without holding thousands of futures.
WINDOW = 200
#: An endpoint sent this many events again at once gets a queue of its own first: a replay of thousands
#: never sits in a lane, in front of other tenants' events.
BULK = 100


@dataclass(frozen=True, slots=True)
class Resend:
    endpoint_id: str
    event_id: str
    body: bytes
    origin: Literal["replay", "redrive"]  # what the delivery log calls its next attempt


async def resend(
    registry: EndpointRegistry, publisher: Publisher, isolation: Isolation, items: Iterable[Resend]
) -> int:
    """Publish each event to its endpoint's address (confirmed); returns how many were published. An
    endpoint sent BULK or more is isolated first (reason ``replay``: the leading monitor takes it back
    to its lane once its queue has drained).

    Without our attempt headers the dispatcher counts it as attempt 1 with the retention window
    starting now: a redriven or replayed event gets the whole retry schedule again.
    """
    chosen = list(items)
    for endpoint_id, count in Counter(item.endpoint_id for item in chosen).items():
        endpoint = registry.get(endpoint_id)
        if count >= BULK and endpoint is not None:
            await isolation.isolate(endpoint, Reason.REPLAY.value)
    pending = []
    sent = 0
    for item in chosen:
        endpoint = registry.get(item.endpoint_id)
        if endpoint is None:
            continue
        message = addressing.message(
            item.body, event_id=item.event_id, endpoint_id=endpoint.id, headers={Header.ORIGIN: item.origin}
        )
        pending.append(addressing.send(publisher, message, destination=registry.placements.address(endpoint)))
        if len(pending) >= WINDOW:
            await asyncio.gather(*pending)
            sent += len(pending)
            pending = []
    await asyncio.gather(*pending)
    return sent + len(pending)
