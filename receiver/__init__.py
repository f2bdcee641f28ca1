"""Receiving hookline's webhooks: verify them (Standard Webhooks) and handle each ``webhook-id`` once.

Imports nothing beyond the standard library; the integrations (``hookline.receiver.fastapi``,
``hookline.receiver.flask``) and the Redis store (``hookline.receiver.redis``) import their framework
when they are imported.
"""

from hookline.receiver.once import AsyncReceiver, Handled, Outcome, Receiver
from hookline.receiver.sequences import Sequences
from hookline.receiver.stores import (
    AsyncSeenStore,
    Claim,
    MemoryStore,
    SeenStore,
    SQLiteStore,
    Status,
    ThreadedStore,
)
from hookline.receiver.verify import (
    BodyEncodingError,
    Delivery,
    InvalidTimestampError,
    MalformedSignatureError,
    MissingHeaderError,
    NoMatchingSignatureError,
    TimestampTooNewError,
    TimestampTooOldError,
    VerificationError,
    verify,
)

__all__ = [
    "AsyncReceiver",
    "AsyncSeenStore",
    "BodyEncodingError",
    "Claim",
    "Delivery",
    "Handled",
    "InvalidTimestampError",
    "MalformedSignatureError",
    "MemoryStore",
    "MissingHeaderError",
    "NoMatchingSignatureError",
    "Outcome",
    "Receiver",
    "SQLiteStore",
    "SeenStore",
    "Sequences",
    "Status",
    "ThreadedStore",
    "TimestampTooNewError",
    "TimestampTooOldError",
    "VerificationError",
    "verify",
]
