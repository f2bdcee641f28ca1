"""What the consumers are to be reconciled for, taken one at a time by the supervised loop (consumers.py):
an endpoint that changed (its record, its breaker), the lanes (:data:`LANES`), or the broker connection
lost (the loop starts over); and whether intake has stopped, after which nothing is attached again.
"""

from __future__ import annotations

import asyncio

from hookline.shared.broker.amqp import ChannelLostError
from hookline.shared.contracts.models import StoredEndpoint

RECONCILE_RETRY_S = 2.0
#: What the change queue carries to say the lanes need attaching again (no endpoint id looks like it).
LANES = "*lanes*"


class Changes:
    def __init__(self) -> None:
        self._changed: asyncio.Queue[str | None] = asyncio.Queue()
        self.connection_lost = asyncio.Event()
        self.stopping = False

    def on_change(self, before: StoredEndpoint | None, after: StoredEndpoint | None) -> None:
        endpoint_id = (after or before).id  # type: ignore[union-attr]
        self._changed.put_nowait(endpoint_id)

    def on_breakers(self, endpoint_ids: set[str] | list[str]) -> None:
        for endpoint_id in endpoint_ids:
            self._changed.put_nowait(endpoint_id)

    def put(self, key: str) -> None:
        """An endpoint id, or :data:`LANES`, to reconcile."""
        self._changed.put_nowait(key)

    def put_later(self, delay_s: float, key: str) -> None:
        asyncio.get_running_loop().call_later(delay_s, self._changed.put_nowait, key)

    def stop(self) -> None:
        """Intake stops: the loop takes no change after this."""
        self.stopping = True
        self._changed.put_nowait(None)

    async def next(self) -> str | None:
        change = asyncio.ensure_future(self._changed.get())
        lost = asyncio.ensure_future(self.connection_lost.wait())
        try:
            await asyncio.wait({change, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
        if change.done():
            return change.result()
        change.cancel()
        raise ChannelLostError("the broker connection was lost; attaching again")
