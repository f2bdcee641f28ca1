"""Signatures follow the Standard Webhooks spec byte for byte; receivers' libraries accept them."""

from __future__ import annotations

import base64

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from hookline.shared.outbound import signing

SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_spec_test_vector() -> None:
    key = signing.secret_key(SPEC_SECRET)
    assert signing.sign(key, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE


def test_several_secrets_give_space_separated_signatures_in_order() -> None:
    other = signing.generate_secret()
    header = signing.signature_header(
        [signing.secret_key(SPEC_SECRET), signing.secret_key(other)], SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY
    )
    first, second = header.split(" ")
    assert first == SPEC_SIGNATURE
    assert signing.verify(other, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY, second)
    assert signing.verify(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY, header)


@pytest.mark.parametrize(
    ("message_id", "timestamp_s", "body"),
    [
        ("msg_other", SPEC_TIMESTAMP, SPEC_BODY),
        (SPEC_ID, SPEC_TIMESTAMP + 1, SPEC_BODY),
        (SPEC_ID, SPEC_TIMESTAMP, b'{"test": 2432232315}'),
    ],
)
def test_verify_rejects_any_change(message_id: str, timestamp_s: int, body: bytes) -> None:
    assert not signing.verify(SPEC_SECRET, message_id, timestamp_s, body, SPEC_SIGNATURE)


def test_generated_secret_is_whsec_and_32_random_bytes() -> None:
    secrets = {signing.generate_secret() for _ in range(50)}
    assert len(secrets) == 50
    for secret in secrets:
        assert secret.startswith("whsec_")
        assert len(base64.b64decode(secret.removeprefix("whsec_"))) == 32


@pytest.mark.parametrize("bad", ["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_not base64!"])
def test_secret_key_refuses_malformed_secrets(bad: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - binascii.Error is a ValueError too
        signing.secret_key(bad)


def test_standardwebhooks_library_verifies_our_signature() -> None:
    import time

    secret = signing.generate_secret()
    now = int(time.time())
    body = b'{"id":"evt_1","type":"order.created"}'
    headers = {
        "webhook-id": "evt_1",
        "webhook-timestamp": str(now),
        "webhook-signature": signing.signature_header([signing.secret_key(secret)], "evt_1", now, body),
    }
    assert Webhook(secret).verify(body, headers) == {"id": "evt_1", "type": "order.created"}
    with pytest.raises(WebhookVerificationError):
        Webhook(signing.generate_secret()).verify(body, headers)
