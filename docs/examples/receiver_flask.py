"""A webhook receiver for hookline's deliveries, with Flask.

    HOOKLINE_SECRET=whsec_... flask --app receiver_flask run --port 9000

Several workers (gunicorn -w 4) share seen.db; with several machines, use ``RedisStore`` from
``hookline.receiver.redis`` instead.
"""

from __future__ import annotations

import logging
import os

from flask import Flask

from hookline.receiver import Delivery, SQLiteStore
from hookline.receiver.flask import webhook

log = logging.getLogger("receiver")
app = Flask(__name__)


@app.post("/webhooks")
@webhook(
    secret=os.environ["HOOKLINE_SECRET"].split(),
    store=SQLiteStore(os.environ.get("RECEIVER_SEEN_DB", "seen.db")),
)
def webhooks(delivery: Delivery) -> None:
    """Runs once per event; the decorator answers. Raise to have hookline retry it."""
    event = delivery.json()
    log.warning("handling %s (%s)", event["id"], event["type"])
