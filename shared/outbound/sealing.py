"""Signing secrets (and the responses the delivery log keeps) sealed at rest: AES-256-GCM under a key derived from ``HOOKLINE_SECRET_KEY``.

With a key set, the ingest writes new secrets to the endpoint change log as ``enc:v2:<base64>``, so the
stream holds no usable secret; the ingest and the dispatchers open them when they sign. Without a key,
secrets are stored as they are (the stream is then as sensitive as the secrets). Secrets stored before
a key was set stay readable; rotate them to seal them.

The key is derived from the setting with HKDF-SHA256 (``enc:v2``); values sealed by earlier versions
under a plain SHA-256 of the setting (``enc:v1``) still open. A setting shorter than
:data:`MIN_KEY_CHARS`, or empty, is refused rather than taken (an empty one used to turn sealing off).
"""

from __future__ import annotations

import base64
import hashlib
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SEALED_PREFIX = "enc:v2:"
_V1_PREFIX = "enc:v1:"
MIN_KEY_CHARS = 32
_HKDF_INFO = b"hookline sealing key v2"
_AAD = b"hookline signing secret"
#: What a receiver answered, as the delivery log keeps it (telemetry stream, the ingest's view).
RESPONSE_PURPOSE = b"hookline response"
_NONCE_BYTES = 12


def check_key(key_material: str) -> None:
    """Refuse a setting too short to be a key (it would be guessable), naming what is wrong."""
    if len(key_material) < MIN_KEY_CHARS:
        raise ValueError(
            f"must be at least {MIN_KEY_CHARS} random characters (got {len(key_material)}); "
            "leave it unset to store secrets unsealed"
        )


class SealedSecretError(Exception):
    """A sealed secret cannot be opened: the key is missing or not the one it was sealed with."""


class Sealer:
    def __init__(self, key_material: str | None) -> None:
        self._aead: AESGCM | None = None
        self._v1: AESGCM | None = None
        if key_material is not None:
            check_key(key_material)
            hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_HKDF_INFO)
            self._aead = AESGCM(hkdf.derive(key_material.encode()))
            self._v1 = AESGCM(hashlib.sha256(key_material.encode()).digest())

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
        if stored.startswith(SEALED_PREFIX):
            prefix, aead = SEALED_PREFIX, self._aead
        elif stored.startswith(_V1_PREFIX):
            prefix, aead = _V1_PREFIX, self._v1
        else:
            return stored
        if aead is None:
            raise SealedSecretError("the endpoint's secret is sealed and HOOKLINE_SECRET_KEY is not set")
        sealed = base64.urlsafe_b64decode(stored.removeprefix(prefix))
        try:
            return aead.decrypt(sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:], purpose).decode()
        except InvalidTag:
            raise SealedSecretError(
                "HOOKLINE_SECRET_KEY is not the key this secret was sealed with"
            ) from None
