"""Bearer tokens in an ``Authorization`` header, as the monitor's API and every service's ``/metrics``
check them. Apart from :mod:`hookline.shared.runtime.api` so that the dispatcher's aiohttp probe server can
use it without importing FastAPI."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

#: What a 401 says, whatever was wrong (no header, another scheme, another token): a guesser learns nothing.
UNAUTHORIZED_MESSAGE = "a valid bearer token is required"


def presents_token(authorization: str, accepted: Iterable[str]) -> bool:
    """Whether ``authorization`` (the header's value) is ``Bearer <one of accepted>``. Every accepted
    token is compared, each in constant time, so the time taken tells nothing about how close a guess
    came or which token it resembled."""
    scheme, _, presented = authorization.partition(" ")
    candidate = presented.strip().encode()
    matches = [hmac.compare_digest(candidate, token.encode()) for token in accepted]
    return scheme.lower() == "bearer" and bool(candidate) and any(matches)
