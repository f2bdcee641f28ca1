"""The request an endpoint receives: its body in the endpoint's format, signed, numbered, compressed."""

from __future__ import annotations

import gzip
from datetime import UTC, datetime

import pytest
from support.factories import stored_endpoint

from hookline.receiver import verify
from hookline.shared.contracts.models import SigningSecret, StoredEndpoint
from hookline.shared.contracts.webhook import webhook_request
from hookline.shared.outbound import signing

SECRET = signing.generate_secret()
KEY = signing.secret_key(SECRET)
NOW = datetime(2026, 12, 1, tzinfo=UTC)
BODY = b'{"id":"evt_1","type":"order.created","tenant":"acme","subject":"o_1","sequence":3,"data":{"x":"%s"}}'


def endpoint(gzip_over_bytes: int | None = None) -> StoredEndpoint:
    return stored_endpoint(
        gzip_over_bytes=gzip_over_bytes, secrets=[SigningSecret(value=SECRET, created_at=NOW)]
    )


@pytest.mark.parametrize(
    ("threshold", "size", "compressed"),
    [(None, 100_000, False), (1024, 900, False), (1024, 2000, True), (0, 10, True)],
)
def test_bodies_over_the_threshold_go_gzipped_and_signed_uncompressed(
    threshold: int | None, size: int, compressed: bool
) -> None:
    body = BODY % (b"a" * size)
    request = webhook_request(endpoint(threshold), [KEY], "evt_1", body, timestamp_s=1_764_547_200)
    assert ("content-encoding" in request.headers) is compressed
    sent = gzip.decompress(request.body) if compressed else request.body
    assert sent == body
    if compressed:
        assert request.headers["content-encoding"] == "gzip"
        assert len(request.body) < len(body)
    # The receiver library inflates before it verifies: the signature is over what it reads.
    delivery = verify(request.headers, request.body, SECRET, now_s=1_764_547_200)
    assert delivery.body == body


def test_compression_is_the_same_on_every_attempt() -> None:
    body = BODY % (b"b" * 5000)
    first = webhook_request(endpoint(10), [KEY], "evt_1", body, timestamp_s=1)
    again = webhook_request(endpoint(10), [KEY], "evt_1", body, timestamp_s=1)
    assert first.body == again.body


@pytest.mark.parametrize(("sequence", "header"), [(None, None), (0, "0"), (42, "42")])
def test_the_sequence_header(sequence: int | None, header: str | None) -> None:
    request = webhook_request(endpoint(), [KEY], "evt_1", BODY, timestamp_s=1, sequence=sequence)
    assert request.headers.get("webhook-sequence") == header
    assert request.headers["webhook-id"] == "evt_1"
