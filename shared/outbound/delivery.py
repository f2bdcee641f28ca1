"""The outbound HTTP client for customer URLs: one signed POST, its timings, an :class:`AttemptResult`.

aiohttp was chosen by measurement (``make bench`` runs the client micro-benchmark): on this 2-core
machine it sends 2-3x the POSTs per second of httpx over the aiohttp transport and 10-15x httpx's own.
One session per process, keep-alive connections, redirects never followed, and every target checked
(:mod:`hookline.shared.outbound.targets`): the scheme and a literal address before the request, the resolved
addresses in the resolver, so the connection goes to an address that was checked.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import socket
import ssl
import time
import weakref
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.connector import Connection

from hookline.shared.outbound.targets import (
    CheckedResolver,
    TargetRefusedError,
    connect_host,
    literal_refusal,
    url_refusal,
)

if TYPE_CHECKING:
    from hookline.shared.runtime.settings import DeliveryPolicySettings


class ErrorKind(enum.StrEnum):
    """Why an attempt got no HTTP status."""

    TIMEOUT = "timeout"
    DNS = "dns"
    CONNECT = "connect"
    TLS = "tls"
    NETWORK = "network"  # the connection broke mid-exchange
    PROTOCOL = "protocol"  # the peer answered something that is not HTTP
    REFUSED_TARGET = "refused_target"  # the address is not allowed (SSRF protection)
    INVALID_URL = "invalid_url"
    AUTH = "auth"  # no credentials to send: the endpoint's OAuth2 token URL did not give a token
    TRANSFORM = "transform_failed"  # nothing to send: the endpoint's transform failed on the event


#: How long a target checked before it is sent through the egress proxy stays checked.
PROXY_CHECK_TTL_S = 60.0
#: What goes into a dead letter's reason of a response body: enough to say why, never the whole thing.
RESPONSE_SNIPPET_BYTES = 512
#: What the delivery log keeps of a response by default: the start of its body, and these headers.
RESPONSE_CAPTURE_BYTES = 4096
CAPTURED_HEADERS = frozenset(
    {"content-type", "content-length", "retry-after", "location", "server", "date", "x-request-id"}
)


@dataclass(frozen=True, slots=True)
class Timings:
    """Milliseconds; the DNS and connect parts are None when a kept-alive connection was reused.

    ``connect_ms`` includes the TLS handshake: aiohttp does not report it apart.
    """

    total_ms: float
    dns_ms: float | None = None
    connect_ms: float | None = None
    first_byte_ms: float | None = None


@dataclass(frozen=True, slots=True)
class AttemptResult:
    status: int | None
    error: ErrorKind | None
    detail: str  # safe to store with a dead letter: no request payload
    retry_after: str | None
    timings: Timings
    response_headers: dict[str, str] = field(default_factory=dict)  # CAPTURED_HEADERS only
    response_body: bytes = b""  # its first ``capture_bytes``

    @classmethod
    def failed(cls, kind: ErrorKind, detail: str) -> AttemptResult:
        """No request was made (the credentials for it could not be had)."""
        return cls(
            status=None, error=kind, detail=detail[:300], retry_after=None, timings=Timings(total_ms=0.0)
        )


class TokenError(Exception):
    """A token URL gave no token; the text says why, without the credentials."""


@dataclass(frozen=True, slots=True)
class TokenAnswer:
    access_token: str
    expires_in_s: float | None


class _Clock:
    __slots__ = ("connect_end", "connect_start", "dns_end", "dns_start", "headers_received", "start")

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.dns_start = self.dns_end = self.connect_start = self.connect_end = self.headers_received = 0.0

    def timings(self) -> Timings:
        def span(begin: float, end: float) -> float | None:
            return round((end - begin) * 1000, 3) if begin and end else None

        return Timings(
            total_ms=round((time.perf_counter() - self.start) * 1000, 3),
            dns_ms=span(self.dns_start, self.dns_end),
            connect_ms=span(self.connect_start, self.connect_end),
            first_byte_ms=span(self.start, self.headers_received),
        )


#: The attempt being made in this task: the connector and the resolver note their timings on it. aiohttp's
#: trace hooks would do the same, but they cost every request about a quarter of its client CPU (measured,
#: ``make bench``) to time the few that open a connection.
_CLOCK: contextvars.ContextVar[_Clock] = contextvars.ContextVar("hookline_attempt_clock")


class _TimedResolver(AbstractResolver):
    """Notes how long a lookup took (aiohttp asks only when its DNS cache misses)."""

    def __init__(self, inner: AbstractResolver) -> None:
        self._inner = inner

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        clock = _CLOCK.get(None)
        started = time.perf_counter()
        try:
            return await self._inner.resolve(host, port, family)
        finally:
            if clock is not None:
                clock.dns_start, clock.dns_end = started, time.perf_counter()

    async def close(self) -> None:
        await self._inner.close()


class _TimedConnector(aiohttp.TCPConnector):
    """Notes how long getting a connection took when it was a new one (lookup, TCP and TLS handshakes);
    a kept-alive connection taken from the pool costs no time worth noting."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._known: weakref.WeakSet[object] = weakref.WeakSet()

    async def connect(
        self,
        req: aiohttp.ClientRequest,
        traces: list[Any],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - aiohttp's signature
    ) -> Connection:
        started = time.perf_counter()
        connection = await super().connect(req, traces, timeout)
        protocol = connection.protocol
        if protocol is not None and protocol not in self._known:
            self._known.add(protocol)
            clock = _CLOCK.get(None)
            if clock is not None:
                clock.connect_start, clock.connect_end = started, time.perf_counter()
        return connection


class DeliveryClient:
    """Owns the HTTP session; ``async with DeliveryClient(...) as client``."""

    @classmethod
    def for_endpoints(
        cls, policy: DeliveryPolicySettings, *, max_connections: int, user_agent: str
    ) -> DeliveryClient:
        """A client for customers' endpoints, under the operator's rules for them: http:// and private
        addresses refused unless allowed, response bodies captured up to the limit, the egress proxy."""
        return cls(
            max_connections=max_connections,
            user_agent=user_agent,
            allow_http=policy.allow_http,
            allow_private=policy.allow_private_targets,
            capture_bytes=policy.response_capture_bytes,
            proxy=policy.egress_proxy,
        )

    def __init__(
        self,
        *,
        max_connections: int,
        user_agent: str,
        allow_http: bool,
        allow_private: bool,
        capture_bytes: int = RESPONSE_CAPTURE_BYTES,
        proxy: str | None = None,
    ) -> None:
        self._max_connections = max_connections
        self._capture_bytes = capture_bytes
        self._user_agent = user_agent
        self._allow_http = allow_http
        self._allow_private = allow_private
        self._session: aiohttp.ClientSession | None = None
        # Through a proxy the connection goes to the proxy, which resolves the target itself: the target
        # is resolved and checked here first (the proxy's own address may be private: it is trusted).
        self._proxy = proxy
        proxy_host = urlsplit(proxy).hostname if proxy else None
        self._trusted = frozenset({proxy_host}) if proxy_host else frozenset()
        self._checker = CheckedResolver()
        self._checked: dict[str, tuple[float, str | None]] = {}  # host -> (until, refusal)

    async def __aenter__(self) -> Self:
        connector = _TimedConnector(
            limit=self._max_connections,
            ttl_dns_cache=60,
            resolver=_TimedResolver(
                aiohttp.DefaultResolver() if self._allow_private else CheckedResolver(trusted=self._trusted)
            ),
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            headers={"user-agent": self._user_agent},
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),  # receivers must not be able to set state between attempts
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()

    async def post(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str],
        *,
        timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> AttemptResult:
        assert self._session is not None, "use DeliveryClient as an async context manager"
        clock = _Clock()
        refusal = self.refusal(url)
        if refusal is None:
            try:
                refusal = await self._proxied_refusal(url)
            except OSError as exc:
                return _failed(ErrorKind.DNS, f"could not resolve the target to check it: {exc}", clock)
        if refusal is not None:
            return _failed(ErrorKind.REFUSED_TARGET, refusal, clock)
        _CLOCK.set(clock)  # set anew by every attempt, and attempts in one task never overlap
        try:
            async with self._session.post(
                url,
                data=body,
                headers=headers,
                allow_redirects=False,
                timeout=_timeout(timeout_s),
                ssl=ssl_context or True,  # a client certificate (mTLS), else the default verification
                proxy=self._proxy,
            ) as response:
                clock.headers_received = time.perf_counter()
                captured = await response.content.read(max(self._capture_bytes, RESPONSE_SNIPPET_BYTES))
                detail = f"HTTP {response.status}"
                if captured and not 200 <= response.status < 300:
                    detail += ": " + captured[:RESPONSE_SNIPPET_BYTES].decode("utf-8", "replace")
                return AttemptResult(
                    status=response.status,
                    error=None,
                    detail=detail,
                    retry_after=response.headers.get("retry-after"),
                    timings=clock.timings(),
                    response_headers={
                        name.lower(): value[:256]
                        for name, value in response.headers.items()
                        if name.lower() in CAPTURED_HEADERS
                    },
                    response_body=captured[: self._capture_bytes],
                )
        except TimeoutError:
            return _failed(ErrorKind.TIMEOUT, f"no response within {timeout_s:g}s", clock)
        except aiohttp.ClientError as exc:
            return _failed(_error_kind(exc), _describe(exc), clock)

    async def fetch_token(
        self, url: str, form: dict[str, str], *, client_id: str, client_secret: str, timeout_s: float
    ) -> TokenAnswer:
        """An OAuth2 client-credentials token from ``url``, checked like any target; raises :class:`TokenError`."""
        assert self._session is not None, "use DeliveryClient as an async context manager"
        try:
            refusal = self.refusal(url) or await self._proxied_refusal(url)
        except OSError as exc:
            raise TokenError(f"could not resolve the token URL to check it: {exc}") from None
        if refusal is not None:
            raise TokenError(refusal)
        try:
            async with self._session.post(
                url,
                data=form,
                auth=aiohttp.BasicAuth(client_id, client_secret),
                headers={"accept": "application/json"},
                allow_redirects=False,
                timeout=_timeout(timeout_s),
                proxy=self._proxy,
            ) as response:
                if response.status != 200:
                    raise TokenError(f"the token URL answered HTTP {response.status}")
                answer = await response.json(content_type=None)
        except TimeoutError:
            raise TokenError(f"the token URL did not answer within {timeout_s:g}s") from None
        except aiohttp.ClientError as exc:
            raise TokenError(_describe(exc)) from None
        except ValueError:
            raise TokenError("the token URL answered something that is not JSON") from None
        token = answer.get("access_token") if isinstance(answer, dict) else None
        if not isinstance(token, str) or not token:
            raise TokenError("the token URL's answer has no access_token")
        expires_in = answer.get("expires_in")
        return TokenAnswer(
            access_token=token,
            expires_in_s=float(expires_in)
            if isinstance(expires_in, int | float) and expires_in > 0
            else None,
        )

    async def _proxied_refusal(self, url: str) -> str | None:
        """Through a proxy: why the target's name may not be called (resolved here, cached a minute).
        A name that does not resolve here raises ``OSError``: it is not sent on for the proxy to resolve."""
        if self._proxy is None or self._allow_private:
            return None
        host = connect_host(url)
        now_s = time.monotonic()
        cached = self._checked.get(host)
        if cached is not None and cached[0] > now_s:
            return cached[1]
        refusal: str | None = None
        try:
            await self._checker.resolve(host, 443)
        except TargetRefusedError as exc:
            refusal = str(exc)
        self._checked[host] = (now_s + PROXY_CHECK_TTL_S, refusal)
        return refusal

    def refusal(self, url: str) -> str | None:
        """Why ``url`` may not be called, as far as can be told without DNS (the resolver does the rest)."""
        refusal = url_refusal(url, allow_http=self._allow_http)
        if refusal is None and not self._allow_private:
            # aiohttp does not ask the resolver about literal addresses: they are checked here.
            refusal = literal_refusal(connect_host(url))
        return refusal


@functools.lru_cache(maxsize=64)
def _timeout(timeout_s: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=timeout_s)


def _failed(kind: ErrorKind, detail: str, clock: _Clock) -> AttemptResult:
    return AttemptResult(status=None, error=kind, detail=detail, retry_after=None, timings=clock.timings())


def _error_kind(exc: aiohttp.ClientError) -> ErrorKind:
    # Order matters: the TLS and DNS errors are subclasses of the connector error.
    if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, TargetRefusedError):
        return ErrorKind.REFUSED_TARGET
    if isinstance(exc, aiohttp.ClientSSLError | aiohttp.ServerFingerprintMismatch):
        return ErrorKind.TLS
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return ErrorKind.DNS
    if isinstance(exc, aiohttp.ClientConnectorError):
        return ErrorKind.CONNECT
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        return ErrorKind.INVALID_URL
    if isinstance(exc, aiohttp.ClientResponseError):
        return ErrorKind.PROTOCOL
    return ErrorKind.NETWORK


def _describe(exc: aiohttp.ClientError) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, TargetRefusedError):
        return f"refused target: {exc.os_error}"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:300]
