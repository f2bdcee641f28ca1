"""Receiver apps built the way a customer writes them, with the secret and the store known only at run
time. No ``from __future__ import annotations`` here on purpose: FastAPI resolves a string annotation
in the module's globals, where a dependency made inside a function is not."""

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, FastAPI, Request, Response

from hookline.receiver import AsyncSeenStore, Delivery, SeenStore
from hookline.receiver.fastapi import VerifiedWebhook, verified_webhook

Handler = Callable[[Delivery], Awaitable[None]]
# Every verified request as it arrived (the raw headers and body): a test replays them.
Seen = Callable[[dict[str, str], bytes], None]


def fastapi_app(
    secret: str | list[str],
    store: SeenStore | AsyncSeenStore,
    handler: Handler,
    *,
    path: str = "/hooks",
    seen: Seen | None = None,
) -> FastAPI:
    app = FastAPI()
    receive = verified_webhook(secret=secret, store=store)

    @app.post(path)
    async def hooks(request: Request, webhook: Annotated[VerifiedWebhook, Depends(receive)]) -> Response:
        if seen is not None:
            seen({k.lower(): v for k, v in request.headers.items()}, webhook.delivery.body)
        return await webhook.once(handler)

    return app
