"""Signing secrets (and the responses the delivery log keeps) sealed at rest: AES-256-GCM under a key derived from ``HOOKLINE_SECRET_KEY``.

With a key set, the ingest writes new secrets to the endpoint change log as ``enc:v1:<base64>``, so the
stream holds no usable secret; the ingest and the dispatchers open them when they sign. Without a key,
secrets are stored as they are (the stream is then as sensitive as the secrets). Secrets stored before
a key was set stay readable; rotate them to seal them.
"""

from __future__ import annotations

import base64
import hashlib
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

SEALED_PREFIX = "enc:v1:"
_AAD = b"hookline signing secret"
#: What a receiver answered, as the delivery log keeps it (telemetry stream, the ingest's view).
RESPONSE_PURPOSE = b"hookline response"
_NONCE_BYTES = 12


class SealedSecretError(Exception):
    """A sealed secret cannot be opened: the key is missing or not the one it was sealed with."""


class Sealer:
    def __init__(self, key_material: str | None) -> None:
        # SHA-256 of the setting: the setting is expected to be long and random (32+ characters).
        self._aead = AESGCM(hashlib.sha256(key_material.encode()).digest()) if key_material else None

    @property
    def sealing(self) -> bool:
        return self._aead is not None

    def seal(self, secret: str, *, purpose: bytes = _AAD) -> str:
        """``purpose`` binds the sealed text to its use: one sealed as a response body does not open as
        a signing secret."""
        if self._aead is None:
            return secret
        nonce = os.urandom(_NONCE_BYTES)
        sealed = nonce + self._aead.encrypt(nonce, secret.encode(), purpose)
        return SEALED_PREFIX + base64.urlsafe_b64encode(sealed).decode()

    def open(self, stored: str, *, purpose: bytes = _AAD) -> str:
        if not stored.startswith(SEALED_PREFIX):
            return stored
        if self._aead is None:
            raise SealedSecretError("the endpoint's secret is sealed and HOOKLINE_SECRET_KEY is not set")
        sealed = base64.urlsafe_b64decode(stored.removeprefix(SEALED_PREFIX))
        try:
            return self._aead.decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], purpose).decode()
        except InvalidTag:
            raise SealedSecretError(
                "HOOKLINE_SECRET_KEY is not the key this secret was sealed with"
            ) from None
