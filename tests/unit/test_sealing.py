"""Secrets sealed at rest open with the right key, and only with it."""

from __future__ import annotations

import pytest

from hookline.shared.models import SigningSecret
from hookline.shared.sealing import SealedSecretError, Sealer
from hookline.shared.signing import generate_secret


def test_sealed_secrets_round_trip_and_fit_the_model() -> None:
    secret = generate_secret()
    sealer = Sealer("k" * 40)
    sealed = sealer.seal(secret)
    assert sealed.startswith("enc:v1:")
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
