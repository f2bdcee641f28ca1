"""The outbound HTTP client for customer URLs: one signed POST, its timings, an :class:`AttemptResult`.

aiohttp was chosen by measurement (``make bench`` runs the client micro-benchmark): on this 2-core
machine it sends 2-3x the POSTs per second of httpx over the aiohttp transport and 10-15x httpx's own.
One session per process, keep-alive connections, redirects never followed, and every target checked
(:mod:`hookline.shared.targets`): the scheme and a literal address before the request, the resolved
addresses in the resolver, so the connection goes to an address that was checked.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from types import SimpleNamespace, TracebackType
from typing import Self

import aiohttp

from hookline.shared.targets import (
    CheckedResolver,
    TargetRefusedError,
    connect_host,
    literal_refusal,
    url_refusal,
)


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


def _trace_config() -> aiohttp.TraceConfig:
    config = aiohttp.TraceConfig()

    def mark(field: str):  # type: ignore[no-untyped-def]
        async def handler(_: aiohttp.ClientSession, context: SimpleNamespace, __: object) -> None:
            setattr(context.trace_request_ctx, field, time.perf_counter())

        return handler

    config.on_dns_resolvehost_start.append(mark("dns_start"))
    config.on_dns_resolvehost_end.append(mark("dns_end"))
    config.on_connection_create_start.append(mark("connect_start"))
    config.on_connection_create_end.append(mark("connect_end"))
    config.on_request_end.append(mark("headers_received"))
    return config


class DeliveryClient:
    """Owns the HTTP session; ``async with DeliveryClient(...) as client``."""

    def __init__(
        self,
        *,
        max_connections: int,
        user_agent: str,
        allow_http: bool,
        allow_private: bool,
        capture_bytes: int = RESPONSE_CAPTURE_BYTES,
    ) -> None:
        self._max_connections = max_connections
        self._capture_bytes = capture_bytes
        self._user_agent = user_agent
        self._allow_http = allow_http
        self._allow_private = allow_private
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections,
            ttl_dns_cache=60,
            resolver=None if self._allow_private else CheckedResolver(),
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            trace_configs=[_trace_config()],
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
        self, url: str, body: bytes, headers: dict[str, str], *, timeout_s: float
    ) -> AttemptResult:
        assert self._session is not None, "use DeliveryClient as an async context manager"
        clock = _Clock()
        refusal = self.refusal(url)
        if refusal is not None:
            return _failed(ErrorKind.REFUSED_TARGET, refusal, clock)
        try:
            async with self._session.post(
                url,
                data=body,
                headers=headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                trace_request_ctx=clock,
            ) as response:
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

    def refusal(self, url: str) -> str | None:
        """Why ``url`` may not be called, as far as can be told without DNS (the resolver does the rest)."""
        refusal = url_refusal(url, allow_http=self._allow_http)
        if refusal is None and not self._allow_private:
            # aiohttp does not ask the resolver about literal addresses: they are checked here.
            refusal = literal_refusal(connect_host(url))
        return refusal


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
