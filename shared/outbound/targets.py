"""Where hookline may send a request: SSRF protection for every outbound call to a customer URL.

By default only ``https`` URLs whose every resolved address is public are allowed. Refused: private
(10/8, 172.16/12, 192.168/16, fc00::/7), loopback, link-local (which holds the cloud metadata address
169.254.169.254), CGNAT (100.64/10), multicast, unspecified, reserved and documentation ranges, and any
of these hidden inside an IPv6 address (IPv4-mapped, 6to4, Teredo). The connection then goes to the
address that was checked (the resolver hands aiohttp only checked addresses), so a DNS answer cannot
change between the check and the connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from urllib.parse import urlsplit

import aiohttp
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class TargetRefusedError(OSError):
    """The URL or the addresses it resolves to are not allowed (a permanent failure, never retried)."""


def address_refusal(address: IPAddress) -> str | None:
    """Why this address may not be called, or None if it is a public unicast address."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour or (address.teredo[1] if address.teredo else None)
        if embedded is not None:
            inner = address_refusal(embedded)
            return f"{inner} (inside {address})" if inner else None
    if isinstance(address, ipaddress.IPv6Address) and address.is_site_local:
        return f"{address} is a site-local address"
    for test, what in (
        (address.is_loopback, "loopback"),
        (address.is_link_local, "link-local (cloud metadata lives here)"),
        (address.is_multicast, "multicast"),
        (address.is_unspecified, "unspecified"),
        (address.is_private, "private"),
        (address.is_reserved, "reserved"),
    ):
        if test:
            return f"{address} is a {what} address"
    if not address.is_global:
        return f"{address} is not a public address"  # CGNAT 100.64/10, benchmarking, documentation, ...
    return None


def connect_host(url: str) -> str:
    """The host aiohttp will connect to: yarl's normalisation (IDNA, Unicode digits and dots folded),
    not what the URL looks like, so the check and the connection see the same host."""
    try:
        return (yarl.URL(url).host or "").strip("[]")
    except (ValueError, UnicodeError):
        return ""


def url_refusal(url: str, *, allow_http: bool) -> str | None:
    """What is wrong with the URL itself (scheme, host), before any DNS lookup."""
    scheme = urlsplit(url).scheme
    if scheme != "https" and not (allow_http and scheme == "http"):
        return (
            "only https URLs are allowed (HOOKLINE_ALLOW_HTTP is off)"
            if scheme == "http"
            else "not an http(s) URL"
        )
    if not connect_host(url):
        return "the URL has no usable host"
    return None


def literal_refusal(host: str) -> str | None:
    """The refusal for a host that is an IP literal; None for names (checked when resolved)."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return address_refusal(address)


class CheckedResolver(AbstractResolver):
    """Resolves like aiohttp's default resolver, then keeps only the addresses that may be called.
    ``trusted`` hosts (the operator's egress proxy) are resolved unchecked."""

    def __init__(self, *, trusted: frozenset[str] = frozenset()) -> None:
        self._inner = aiohttp.DefaultResolver()
        self._trusted = trusted

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        if host in self._trusted:
            return results
        allowed = [
            result for result in results if address_refusal(ipaddress.ip_address(result["host"])) is None
        ]
        if not allowed:
            # Which internal addresses a name resolves to is not the caller's to learn (this message
            # reaches API answers and the delivery log).
            raise TargetRefusedError(f"{host} does not resolve to a public address")
        return allowed

    async def close(self) -> None:
        await self._inner.close()


async def registration_refusal(
    url: str, *, allow_http: bool, allow_private: bool, timeout_s: float = 5.0
) -> str | None:
    """Everything that makes ``url`` refused at registration: scheme, and what its host resolves to."""
    refusal = url_refusal(url, allow_http=allow_http)
    if refusal is not None or allow_private:
        return refusal
    host = connect_host(url)
    with contextlib.suppress(ValueError):
        return address_refusal(ipaddress.ip_address(host))  # a literal address: no lookup
    resolver = CheckedResolver()
    try:
        await asyncio.wait_for(resolver.resolve(host, 443), timeout_s)
    except TargetRefusedError as exc:
        return str(exc)
    except (OSError, TimeoutError):
        return None  # not resolvable now: checked again at every delivery
    finally:
        await resolver.close()
    return None
