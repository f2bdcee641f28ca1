"""Secrets sealed at rest open with the right key, and only with it."""

from __future__ import annotations

import base64
import hashlib
import os

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import ValidationError

from hookline.ingest.settings import IngestSettings
from hookline.shared.contracts.models import SigningSecret
from hookline.shared.outbound.sealing import SealedSecretError, Sealer
from hookline.shared.outbound.signing import generate_secret


def test_sealed_secrets_round_trip_and_fit_the_model() -> None:
    secret = generate_secret()
    sealer = Sealer("k" * 40)
    sealed = sealer.seal(secret)
    assert sealed.startswith("enc:v2:")
    assert secret not in sealed
    assert sealer.seal(secret) != sealed, "a fresh nonce every time"
    assert sealer.open(sealed) == secret
    SigningSecret.model_validate({"value": sealed, "created_at": "2026-11-29T18:00:00Z"})


def test_without_a_key_secrets_are_stored_as_they_are() -> None:
    secret = generate_secret()
    assert Sealer(None).seal(secret) == secret
    assert Sealer(None).open(secret) == secret
    assert Sealer("k" * 40).open(secret) == secret, "secrets stored before a key was set stay readable"


@pytest.mark.parametrize(("key", "message"), [(None, "is not set"), ("w" * 40, "is not the key")])
def test_a_missing_or_wrong_key_is_a_clear_error(key: str | None, message: str) -> None:
    sealed = Sealer("k" * 40).seal(generate_secret())
    with pytest.raises(SealedSecretError, match=message):
        Sealer(key).open(sealed)


def test_a_secret_sealed_before_hkdf_still_opens() -> None:
    """enc:v1 values (AES-GCM under SHA-256 of the setting) are in existing change logs."""
    key, secret = "k" * 40, generate_secret()
    nonce = os.urandom(12)
    sealed = nonce + AESGCM(hashlib.sha256(key.encode()).digest()).encrypt(
        nonce, secret.encode(), b"hookline signing secret"
    )
    v1 = "enc:v1:" + base64.urlsafe_b64encode(sealed).decode()
    assert Sealer(key).open(v1) == secret
    SigningSecret.model_validate({"value": v1, "created_at": "2026-11-29T18:00:00Z"})
    with pytest.raises(SealedSecretError, match="is not the key"):
        Sealer("w" * 40).open(v1)


@pytest.mark.parametrize("key", ["", "short", "k" * 31])
def test_a_short_or_empty_key_is_refused_not_taken_as_no_key(key: str) -> None:
    with pytest.raises(ValueError, match="at least 32"):
        Sealer(key)
    with pytest.raises(ValidationError, match=r"HOOKLINE_SECRET_KEY|secret_key"):
        IngestSettings(api_token="a" * 16, secret_key=key)  # type: ignore[arg-type]
