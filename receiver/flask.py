"""A Flask view decorator: the view runs with the verified delivery, once per ``webhook-id``.

    @app.post("/webhooks")
    @webhook(secret=os.environ["HOOKLINE_SECRET"], store=SQLiteStore("seen.db"))
    def on_webhook(delivery: Delivery) -> None:
        ...

The view's return value is not the answer: the decorator answers 204 handled, 200 duplicate, 503 in
progress, 400/401 refused; a view that raises propagates (Flask answers 500, hookline retries).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Concatenate, ParamSpec

from flask import Response, request

from hookline.receiver import replies
from hookline.receiver.once import Receiver
from hookline.receiver.stores import Clock, SeenStore
from hookline.receiver.verify import DEFAULT_TOLERANCE_S, Delivery, Secrets, VerificationError

log = logging.getLogger("hookline.receiver")

P = ParamSpec("P")


def webhook(
    secret: Secrets,
    store: SeenStore | None = None,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    clock: Clock = time.time,
) -> Callable[[Callable[Concatenate[Delivery, P], object]], Callable[P, Response]]:
    receiver = Receiver(secret, store, tolerance_s=tolerance_s, clock=clock)

    def decorate(view: Callable[Concatenate[Delivery, P], object]) -> Callable[P, Response]:
        @functools.wraps(view)
        def receive(*args: P.args, **kwargs: P.kwargs) -> Response:
            try:
                delivery = receiver.verify(dict(request.headers.items()), request.get_data())
            except VerificationError as error:
                log.warning("webhook refused: %s", error.reason)
                return _response(replies.for_error(error))
            handled = receiver.once(delivery, lambda verified: view(verified, *args, **kwargs))
            return _response(replies.for_outcome(handled.outcome))

        return receive

    return decorate


def _response(reply: replies.Reply) -> Response:
    return Response(reply.body, reply.status, reply.headers, mimetype=reply.media_type)
