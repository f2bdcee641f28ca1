"""A FastAPI (Starlette) dependency: the route gets a verified webhook, or the request is refused.

receive = verified_webhook(secret=os.environ["HOOKLINE_SECRET"], store=SQLiteStore("seen.db"))

@app.post("/webhooks")
async def webhooks(webhook: Annotated[VerifiedWebhook, Depends(receive)]) -> Response:
    return await webhook.once(handle)  # 204 handled, 200 duplicate, 503 in progress
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable

from fastapi import HTTPException, Request, Response

from hookline.receiver import replies
from hookline.receiver.once import AsyncReceiver, Handled
from hookline.receiver.stores import AsyncSeenStore, Clock, SeenStore
from hookline.receiver.verify import DEFAULT_TOLERANCE_S, Delivery, Secrets, VerificationError

log = logging.getLogger("hookline.receiver")

Handler = Callable[[Delivery], Awaitable[object] | object]


class VerifiedWebhook:
    """A genuine delivery, and the way to handle it once."""

    def __init__(self, delivery: Delivery, receiver: AsyncReceiver) -> None:
        self.delivery = delivery
        self.receiver = receiver

    @property
    def webhook_id(self) -> str:
        return self.delivery.webhook_id

    async def run_once(self, handler: Handler) -> Handled[object]:
        """Run ``handler`` (sync or async) unless this webhook-id was handled; what happened."""

        async def call(delivery: Delivery) -> object:
            result = handler(delivery)
            return await result if inspect.isawaitable(result) else result

        return await self.receiver.once(self.delivery, call)

    async def once(self, handler: Handler) -> Response:
        """``run_once``, answered as hookline expects. A handler that raises propagates (a 500)."""
        return response(replies.for_outcome((await self.run_once(handler)).outcome))


def response(reply: replies.Reply) -> Response:
    return Response(reply.body, reply.status, reply.headers, reply.media_type)


def verified_webhook(
    secret: Secrets,
    store: SeenStore | AsyncSeenStore | None = None,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    clock: Clock = time.time,
) -> Callable[[Request], Awaitable[VerifiedWebhook]]:
    """A dependency that verifies the request with ``secret`` (one, or several while rotating); a
    request that fails is answered 400 (401: no signature matches) with ``{"detail": <reason>}``."""
    receiver = AsyncReceiver(secret, store, tolerance_s=tolerance_s, clock=clock)

    async def dependency(request: Request) -> VerifiedWebhook:
        body = await request.body()
        try:
            delivery = receiver.verify(request.headers, body)
        except VerificationError as error:
            log.warning("webhook refused: %s", error.reason)
            raise HTTPException(replies.for_error(error).status, detail=error.reason) from None
        return VerifiedWebhook(delivery, receiver)

    return dependency
