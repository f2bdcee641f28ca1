"""What goes on the wire to an endpoint for one event: the body in the endpoint's format, the Standard
Webhooks headers signing it, the event's sequence, and the body compressed when the endpoint asks.

One definition for the dispatcher's attempts and the ingest's own (a resend, the verification
handshake), so that a receiver cannot tell them apart.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable
from dataclasses import dataclass

from hookline.shared.contracts.models import StoredEndpoint
from hookline.shared.outbound import signing
from hookline.shared.state import notifications

#: The header carrying the event's ``sequence`` (its place among the events of its subject).
SEQUENCE_HEADER = "webhook-sequence"

# Level 6 is zlib's default: within a few percent of 9's size on JSON at a third of its CPU.
_GZIP_LEVEL = 6


@dataclass(frozen=True, slots=True)
class WebhookRequest:
    body: bytes
    headers: dict[str, str]


def webhook_request(
    endpoint: StoredEndpoint,
    keys: Iterable[bytes],
    event_id: str,
    body: bytes,
    *,
    timestamp_s: int,
    sequence: int | None = None,
    transformed: bytes | None = None,
) -> WebhookRequest:
    """The request for ``body`` (the event as published), or for ``transformed`` (what the endpoint's
    transform made of it: sent and signed as it is). The signature covers the body before any
    compression: what the receiver verifies is what it reads after inflating, whatever the transport."""
    body = transformed if transformed is not None else notifications.render(endpoint.body_format, body)
    headers = signing.webhook_headers(keys, event_id, body, timestamp_s=timestamp_s)
    if sequence is not None:
        headers[SEQUENCE_HEADER] = str(sequence)
    if endpoint.gzip_over_bytes is not None and len(body) > endpoint.gzip_over_bytes:
        # mtime=0: the same body compresses to the same bytes on every attempt.
        body = gzip.compress(body, compresslevel=_GZIP_LEVEL, mtime=0)
        headers["content-encoding"] = "gzip"
    return WebhookRequest(body, headers)
