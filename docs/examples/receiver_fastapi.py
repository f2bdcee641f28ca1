"""A webhook receiver for hookline's deliveries, with FastAPI.

    HOOKLINE_SECRET=whsec_... uvicorn receiver_fastapi:app --port 9000

Register http://<host>:9000/webhooks as the endpoint's URL; put its ``secret`` (shown once, when the
endpoint is created) in HOOKLINE_SECRET. While a secret is rotated, give both, space separated: the
receiver accepts a delivery signed with either. Handled ids are kept in seen.db (SQLite), so that a
retried, resent or replayed delivery is answered 200 without running ``handle`` again; with several
machines, use ``AsyncRedisStore`` from ``hookline.receiver.redis`` instead.
"""

from __future__ import annotations

import logging
import os
from typing import Annotated

from fastapi import Depends, FastAPI, Response

from hookline.receiver import Delivery, SQLiteStore
from hookline.receiver.fastapi import VerifiedWebhook, verified_webhook

log = logging.getLogger("receiver")
app = FastAPI()
receive = verified_webhook(
    secret=os.environ["HOOKLINE_SECRET"].split(),
    store=SQLiteStore(os.environ.get("RECEIVER_SEEN_DB", "seen.db")),
)


async def handle(delivery: Delivery) -> None:
    """Runs once per event. Raise to have hookline retry it (the event is then not recorded)."""
    event = delivery.json()
    log.warning("handling %s (%s)", event["id"], event["type"])


@app.post("/webhooks")
async def webhooks(webhook: Annotated[VerifiedWebhook, Depends(receive)]) -> Response:
    # 204 handled now, 200 handled before, 503 + Retry-After while another request handles it.
    return await webhook.once(handle)
