"""Verifying a delivery as Standard Webhooks defines it, the way hookline signs (hookline.shared.outbound.signing).

A delivery carries ``webhook-id``, ``webhook-timestamp`` (Unix seconds) and ``webhook-signature``: a space
separated list of ``v1,<base64 HMAC-SHA256(key, "<id>.<timestamp>.<body>")>``, one per secret the sender
signs with (several while a secret is rotated). A receiver may hold several secrets too; a delivery is
genuine when any listed ``v1`` signature matches any held secret.

Pure: the caller passes the time. Self-contained on purpose: a customer's receiver imports this without
hookline's service dependencies. Error texts name the problem, never a secret, signature or payload.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

SECRET_PREFIX = "whsec_"  # noqa: S105 - a format prefix, not a secret
DEFAULT_TOLERANCE_S = 300

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
SEQUENCE_HEADER = "webhook-sequence"
ENCODING_HEADER = "content-encoding"

#: The most a gzip body may inflate to (hookline's own payload limit is far below): more is a bomb.
MAX_INFLATED_BYTES = 16 * 1024 * 1024

# Far more than any rotation needs; a longer list is an attempt to make the receiver work for nothing.
MAX_SIGNATURES = 16
_MAX_TIMESTAMP_DIGITS = 12

Secrets = str | Iterable[str]


class VerificationError(Exception):
    """The request is not a genuine, fresh delivery. ``reason`` is a stable code for answers and logs."""

    reason: ClassVar[str] = "verification_failed"


class MissingHeaderError(VerificationError):
    reason = "missing_header"

    def __init__(self, header: str) -> None:
        super().__init__(f"the {header} header is missing or empty")
        self.header = header


class InvalidTimestampError(VerificationError):
    reason = "invalid_timestamp"


class TimestampTooOldError(VerificationError):
    reason = "timestamp_too_old"


class TimestampTooNewError(VerificationError):
    reason = "timestamp_too_new"


class MalformedSignatureError(VerificationError):
    reason = "malformed_signature"


class NoMatchingSignatureError(VerificationError):
    reason = "no_matching_signature"


class BodyEncodingError(VerificationError):
    """``content-encoding`` names what this library cannot read, or a gzip body that does not inflate."""

    reason = "invalid_body_encoding"


@dataclass(frozen=True, slots=True)
class Delivery:
    """A verified delivery: its id (the event's id, the same on every retry and resend) and its body
    (inflated, when it came gzip-compressed: the signature covers the inflated body)."""

    webhook_id: str
    timestamp_s: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def signing_keys(secrets: Secrets) -> tuple[bytes, ...]:
    """The HMAC keys inside ``whsec_`` secrets; ValueError (naming the position, not the secret) if one
    is malformed, so that a misconfigured receiver fails at start, not on its first delivery."""
    listed = [secrets] if isinstance(secrets, str) else list(secrets)
    if not listed:
        raise ValueError("at least one signing secret is needed")
    keys = []
    for position, secret in enumerate(listed, start=1):
        if not secret.startswith(SECRET_PREFIX):
            raise ValueError(f"signing secret #{position} does not start with {SECRET_PREFIX}")
        try:
            key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
        except binascii.Error:
            raise ValueError(f"signing secret #{position} is not base64 after {SECRET_PREFIX}") from None
        if not key:
            raise ValueError(f"signing secret #{position} is empty")
        keys.append(key)
    return tuple(keys)


def verify(
    headers: Mapping[str, str],
    body: bytes,
    secrets: Secrets,
    *,
    now_s: float,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> Delivery:
    """The delivery ``headers`` and ``body`` make, if genuine and signed within ``tolerance_s`` of
    ``now_s`` (either way: clocks drift); else the VerificationError that says why."""
    keys = signing_keys(secrets)
    body = _inflated(headers, body)
    webhook_id = _header(headers, ID_HEADER)
    timestamp_s = _timestamp_s(_header(headers, TIMESTAMP_HEADER), now_s=now_s, tolerance_s=tolerance_s)
    candidates = _v1_signatures(_header(headers, SIGNATURE_HEADER))
    signed = b"%s.%d.%s" % (webhook_id.encode(), timestamp_s, body)
    matched = False
    for key in keys:
        expected = base64.b64encode(hmac.digest(key, signed, hashlib.sha256))
        for candidate in candidates:
            # No early exit: how long this takes says nothing about which pair matched.
            matched |= hmac.compare_digest(expected, candidate)
    if not matched:
        raise NoMatchingSignatureError("no signature matches a configured secret")
    return Delivery(webhook_id=webhook_id, timestamp_s=timestamp_s, body=body)


def _inflated(headers: Mapping[str, str], body: bytes) -> bytes:
    encoding = (_optional_header(headers, ENCODING_HEADER) or "identity").lower()
    if encoding == "identity":
        return body
    if encoding != "gzip":
        raise BodyEncodingError(f"{ENCODING_HEADER} {encoding!r} is not gzip")
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        inflated = inflater.decompress(body, MAX_INFLATED_BYTES)
    except zlib.error:
        raise BodyEncodingError("the gzip body does not inflate") from None
    if inflater.unconsumed_tail:
        raise BodyEncodingError(f"the gzip body inflates to more than {MAX_INFLATED_BYTES} bytes")
    if not inflater.eof:
        raise BodyEncodingError("the gzip body is truncated")
    return inflated


def _optional_header(headers: Mapping[str, str], name: str) -> str | None:
    # Framework header maps are case-insensitive; a plain dict may not be.
    value = headers.get(name)
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return value.strip() if value is not None and value.strip() else None


def _header(headers: Mapping[str, str], name: str) -> str:
    value = _optional_header(headers, name)
    if value is None:
        raise MissingHeaderError(name)
    return value


def _timestamp_s(value: str, *, now_s: float, tolerance_s: float) -> int:
    if not (value.isascii() and value.isdigit() and len(value) <= _MAX_TIMESTAMP_DIGITS):
        raise InvalidTimestampError(f"{TIMESTAMP_HEADER} is not Unix seconds")
    timestamp_s = int(value)
    age_s = now_s - timestamp_s
    if age_s > tolerance_s:
        raise TimestampTooOldError(f"signed {age_s:.0f} s ago, more than the {tolerance_s:g} s tolerance")
    if -age_s > tolerance_s:
        raise TimestampTooNewError(f"signed {-age_s:.0f} s ahead, more than the {tolerance_s:g} s tolerance")
    return timestamp_s


def _v1_signatures(value: str) -> list[bytes]:
    entries = value.split()
    if len(entries) > MAX_SIGNATURES:
        raise MalformedSignatureError(f"{SIGNATURE_HEADER} lists more than {MAX_SIGNATURES} signatures")
    signatures = []
    for entry in entries:
        version, comma, signature = entry.partition(",")
        if not comma or not version or not signature:
            raise MalformedSignatureError(f"an entry of {SIGNATURE_HEADER} is not <version>,<signature>")
        # Other versions (v1a: asymmetric) are skipped, as the spec asks, not refused.
        if version == "v1":
            signatures.append(signature.encode())
    if not signatures:
        raise MalformedSignatureError(f"{SIGNATURE_HEADER} holds no v1 signature")
    return signatures
