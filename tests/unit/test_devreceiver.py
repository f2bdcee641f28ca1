"""The walkthrough's receiver says whether a delivery's signature verifies."""

from __future__ import annotations

import time

from hookline.cli.devreceiver import _verdict
from hookline.shared.outbound import signing


def test_verdicts() -> None:
    secret = signing.generate_secret()
    now = int(time.time())
    body = b'{"id":"evt_1"}'
    headers = {
        "webhook-id": "evt_1",
        "webhook-timestamp": str(now),
        "webhook-signature": signing.signature_header([signing.secret_key(secret)], "evt_1", now, body),
    }
    assert _verdict(headers, body, secret) == "valid"
    assert _verdict(headers, body + b" ", secret) == "INVALID signature"
    assert _verdict({**headers, "webhook-timestamp": str(now - 3600)}, body, secret).startswith("INVALID")
    assert _verdict(headers, body, None).startswith("unchecked")
