"""Identifiers: a prefix plus a ULID (time-ordered, 26 Crockford base32 characters).

Time-ordered ids keep ``GET /v1/endpoints`` and the logs readable in creation order. The clock and the
random bytes are parameters so the encoding can be tested exactly.
"""

from __future__ import annotations

import hashlib
import os
import time

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def encode_ulid(timestamp_ms: int, randomness: bytes) -> str:
    """Encode 48 bits of milliseconds and 80 bits of randomness as a 26-character ULID."""
    if len(randomness) != 10:
        raise ValueError("a ULID needs exactly 10 random bytes")
    value = (timestamp_ms & ((1 << 48) - 1)) << 80 | int.from_bytes(randomness, "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def new_id(prefix: str) -> str:
    """A fresh id such as ``evt_01JD…`` or ``ep_01JD…``."""
    return f"{prefix}_{encode_ulid(time.time_ns() // 1_000_000, os.urandom(10))}"


def derived_id(prefix: str, seed: str) -> str:
    """The same id for the same ``seed`` everywhere (an event sent with an idempotency key): 32
    characters from its SHA-256, so that it is never taken for a time-ordered id (26)."""
    value = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:20], "big")
    return f"{prefix}_" + "".join(_CROCKFORD[(value >> shift) & 31] for shift in range(155, -1, -5))


def id_time_s(identifier: str) -> float | None:
    """When an id made by :func:`new_id` was made (unix seconds, millisecond precision); None for an id
    that is not prefix + ULID (an upstream may choose its own event ids)."""
    _, _, ulid = identifier.rpartition("_")
    if len(ulid) != 26 or any(char not in _CROCKFORD for char in ulid):
        return None
    value = 0
    for char in ulid[:10]:
        value = value * 32 + _CROCKFORD.index(char)
    return value / 1000
