"""What a request to an endpoint carries besides hookline's signature: the endpoint's own headers and
its authentication (HTTP basic, a bearer token, an OAuth2 client-credentials token, a TLS client
certificate).

The ingest seals the secrets when an endpoint is written (header values, the password, token, client
secret or private key: :func:`stored_headers`, :func:`stored_auth`); whoever makes the requests (the
dispatchers, the ingest for a verification or a resend) opens them here, once per endpoint version.
OAuth2 tokens are fetched through the delivery client, so the token URL gets the same SSRF checks as
the endpoint; one fetch per endpoint at a time, cached until shortly before the token expires, and a
401 from the endpoint fetches a new one once, within the same attempt.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from hookline.shared.contracts.models import (
    BasicAuth,
    BearerAuth,
    EndpointAuth,
    MtlsAuth,
    OAuth2ClientCredentials,
    StoredEndpoint,
)
from hookline.shared.outbound.delivery import AttemptResult, DeliveryClient, ErrorKind, TokenError
from hookline.shared.outbound.sealing import Sealer

#: Sealed endpoint credentials open only as such (not as a signing secret or a response body).
PURPOSE = b"hookline endpoint credential"
#: A token is used for this share of its lifetime, then fetched again before it runs out.
TOKEN_USE_SHARE = 0.8
#: A token answer without ``expires_in`` is used this long.
TOKEN_DEFAULT_LIFETIME_S = 300.0
TOKEN_TIMEOUT_S = 10.0


# --- sealing, at the ingest ------------------------------------------------------------------------


def stored_headers(sealer: Sealer, headers: Mapping[str, str] | None) -> dict[str, Any]:
    """The endpoint fields for these headers: sealed values, and the names the API shows."""
    headers = headers or {}
    return {
        "sealed_headers": {name: sealer.seal(value, purpose=PURPOSE) for name, value in headers.items()},
        "headers": sorted(headers),
    }


def stored_auth(sealer: Sealer, auth: EndpointAuth | None) -> dict[str, Any]:
    """The endpoint fields for this auth: its secret part sealed, and the summary the API shows."""
    if auth is None:
        return {"sealed_auth": None, "auth": None}
    field = _SECRET_FIELD[type(auth)]
    sealed = auth.model_copy(update={field: sealer.seal(getattr(auth, field), purpose=PURPOSE)})
    return {"sealed_auth": sealed, "auth": auth.summary()}


def certificate_problem(auth: MtlsAuth) -> str | None:
    """Why this certificate and key cannot be used for TLS (None: they can)."""
    try:
        _client_context(auth.certificate, auth.private_key)
    except (ssl.SSLError, ValueError) as exc:
        return f"the certificate and private key do not load: {exc.__class__.__name__}"
    return None


_SECRET_FIELD: dict[type, str] = {
    BasicAuth: "password",
    BearerAuth: "token",
    OAuth2ClientCredentials: "client_secret",
    MtlsAuth: "private_key",
}


# --- at request time --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Opened:
    version: datetime  # the endpoint's updated_at: a change opens them again
    headers: dict[str, str]
    ssl: ssl.SSLContext | None
    oauth: OAuth2ClientCredentials | None  # with its client secret opened


@dataclass(slots=True)
class _Token:
    value: str
    refresh_at_s: float


class Credentials:
    """Per process: the opened credentials of the endpoints it calls, and their OAuth2 tokens."""

    def __init__(
        self, sealer: Sealer, client: DeliveryClient, *, clock_s: Callable[[], float] = time.monotonic
    ) -> None:
        self._sealer = sealer
        self._client = client
        self._clock_s = clock_s
        self._opened: dict[str, _Opened] = {}
        self._tokens: dict[str, _Token] = {}
        self._fetching: dict[str, asyncio.Future[_Token]] = {}

    async def post(self, endpoint: StoredEndpoint, body: bytes, signed: dict[str, str]) -> AttemptResult:
        """One attempt: ``body`` with hookline's signature headers and the endpoint's own."""
        url = endpoint.url
        if url is None:  # a polling endpoint: the API refuses to push to it, so only a race gets here
            return AttemptResult.failed(ErrorKind.INVALID_URL, "a polling endpoint has no url to push to")
        opened = self._open(endpoint)
        if opened.oauth is None and not opened.headers and opened.ssl is None:
            return await self._client.post(url, body, signed, timeout_s=endpoint.timeout_s)
        for fresh in (False, True):
            headers = {**opened.headers, **signed}
            if opened.oauth is not None:
                try:
                    token = await self._token(endpoint.id, opened, fresh=fresh)
                except TokenError as exc:
                    return AttemptResult.failed(ErrorKind.AUTH, f"no OAuth2 token: {exc}")
                headers["authorization"] = f"Bearer {token}"
            result = await self._client.post(
                url, body, headers, timeout_s=endpoint.timeout_s, ssl_context=opened.ssl
            )
            if result.status != 401 or opened.oauth is None or fresh:
                return result
            # The endpoint no longer takes the token (revoked, or its clock ran ahead): a new one, once.
        raise AssertionError("unreachable")

    def _open(self, endpoint: StoredEndpoint) -> _Opened:
        opened = self._opened.get(endpoint.id)
        if opened is not None and opened.version == endpoint.updated_at:
            return opened
        headers = {
            name: self._sealer.open(value, purpose=PURPOSE) for name, value in endpoint.sealed_headers.items()
        }
        auth, context, oauth = endpoint.sealed_auth, None, None
        if isinstance(auth, BasicAuth):
            pair = f"{auth.username}:{self._sealer.open(auth.password, purpose=PURPOSE)}"
            headers["authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        elif isinstance(auth, BearerAuth):
            headers["authorization"] = f"Bearer {self._sealer.open(auth.token, purpose=PURPOSE)}"
        elif isinstance(auth, OAuth2ClientCredentials):
            oauth = auth.model_copy(
                update={"client_secret": self._sealer.open(auth.client_secret, purpose=PURPOSE)}
            )
        elif isinstance(auth, MtlsAuth):
            context = _client_context(auth.certificate, self._sealer.open(auth.private_key, purpose=PURPOSE))
        opened = _Opened(version=endpoint.updated_at, headers=headers, ssl=context, oauth=oauth)
        self._opened[endpoint.id] = opened
        self._tokens.pop(endpoint.id, None)  # the auth may have changed: its token with it
        return opened

    async def _token(self, endpoint_id: str, opened: _Opened, *, fresh: bool) -> str:
        cached = self._tokens.get(endpoint_id)
        if cached is not None and not fresh and self._clock_s() < cached.refresh_at_s:
            return cached.value
        fetching = self._fetching.get(endpoint_id)
        if fetching is None:
            assert opened.oauth is not None
            fetching = asyncio.ensure_future(self._fetch(opened.oauth))
            self._fetching[endpoint_id] = fetching
            fetching.add_done_callback(lambda _: self._fetching.pop(endpoint_id, None))
        token = await asyncio.shield(fetching)  # one waiter cancelled does not cancel the others' fetch
        self._tokens[endpoint_id] = token
        return token.value

    async def _fetch(self, oauth: OAuth2ClientCredentials) -> _Token:
        form = {"grant_type": "client_credentials"}
        if oauth.scope:
            form["scope"] = oauth.scope
        if oauth.audience:
            form["audience"] = oauth.audience
        started_s = self._clock_s()
        answer = await self._client.fetch_token(
            oauth.token_url, form, client_id=oauth.client_id, client_secret=oauth.client_secret,
            timeout_s=TOKEN_TIMEOUT_S,
        )  # fmt: skip
        lifetime_s = answer.expires_in_s or TOKEN_DEFAULT_LIFETIME_S
        return _Token(value=answer.access_token, refresh_at_s=started_s + lifetime_s * TOKEN_USE_SHARE)


def _client_context(certificate: str, private_key: str) -> ssl.SSLContext:
    """A TLS context that verifies servers as usual and presents this client certificate."""
    context = ssl.create_default_context()
    # load_cert_chain reads files only: the PEM goes through a private temporary file, removed at once.
    with tempfile.TemporaryDirectory() as directory:  # created 0700: only this process reads it
        path = Path(directory) / "client.pem"
        path.write_text(private_key.strip() + "\n" + certificate.strip() + "\n")
        context.load_cert_chain(path)
    return context
