"""Standard Webhooks signatures: ``v1,<base64 HMAC-SHA256(secret, "<id>.<timestamp>.<body>")>``.

Receivers verify with the ``standardwebhooks`` or ``svix`` libraries unchanged. During a secret
rotation a delivery carries one signature per valid secret, space separated.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Iterable

SECRET_PREFIX = "whsec_"  # noqa: S105 - a format prefix, not a secret
SECRET_BYTES = 32


def generate_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_key(secret: str) -> bytes:
    """The HMAC key inside a ``whsec_`` secret."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError("a signing secret starts with whsec_")
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)


def sign(key: bytes, message_id: str, timestamp_s: int, body: bytes) -> str:
    """One ``v1,`` signature of a delivery."""
    signed = b"%s.%d.%s" % (message_id.encode(), timestamp_s, body)
    return "v1," + base64.b64encode(hmac.digest(key, signed, hashlib.sha256)).decode()


def signature_header(keys: Iterable[bytes], message_id: str, timestamp_s: int, body: bytes) -> str:
    """The ``webhook-signature`` value: one signature per key, space separated."""
    return " ".join(sign(key, message_id, timestamp_s, body) for key in keys)


def webhook_headers(
    keys: Iterable[bytes], message_id: str, body: bytes, *, timestamp_s: int
) -> dict[str, str]:
    """The headers of a delivery (Standard Webhooks): its id, when it was signed, and the signatures."""
    return {
        "content-type": "application/json",
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp_s),
        "webhook-signature": signature_header(keys, message_id, timestamp_s, body),
    }


def verify(secret: str, message_id: str, timestamp_s: int, body: bytes, header: str) -> bool:
    """True when any ``v1,`` signature in ``header`` matches (constant-time comparison)."""
    expected = sign(secret_key(secret), message_id, timestamp_s, body).encode()
    return any(hmac.compare_digest(expected, candidate.encode()) for candidate in header.split())
