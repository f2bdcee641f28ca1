"""SSRF protection: the table of addresses that are refused by default, and the URL rules."""

from __future__ import annotations

import ipaddress

import pytest

from hookline.shared.outbound.targets import (
    address_refusal,
    literal_refusal,
    registration_refusal,
    url_refusal,
)

REFUSED = [
    "127.0.0.1",
    "127.1.2.3",
    "10.0.0.1",
    "10.255.255.255",
    "172.16.0.1",
    "172.31.255.254",
    "192.168.1.1",
    "169.254.169.254",  # cloud metadata
    "169.254.0.1",
    "100.64.0.1",  # CGNAT
    "100.127.255.254",
    "0.0.0.0",
    "224.0.0.1",  # multicast
    "239.255.255.250",
    "240.0.0.1",  # reserved
    "255.255.255.255",
    "192.0.2.1",  # documentation
    "198.18.0.1",  # benchmarking
    "::1",
    "::",
    "fc00::1",
    "fd12:3456::1",
    "fe80::1",
    "ff02::1",
    "::ffff:127.0.0.1",  # IPv4-mapped
    "::ffff:10.0.0.1",
    "::ffff:169.254.169.254",
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "2002:a00:1::1",  # 6to4 of 10.0.0.1
    "fd00:ec2::254",  # AWS metadata over IPv6
]
ALLOWED = [
    "93.184.216.34",
    "8.8.8.8",
    "1.1.1.1",
    "2606:4700:4700::1111",
    "::ffff:8.8.8.8",
    "100.128.0.1",
    "172.32.0.1",
]


@pytest.mark.parametrize("address", REFUSED)
def test_refused_addresses(address: str) -> None:
    reason = address_refusal(ipaddress.ip_address(address))
    assert reason is not None
    assert literal_refusal(f"[{address}]" if ":" in address else address) == reason


@pytest.mark.parametrize("address", ALLOWED)
def test_public_addresses_are_allowed(address: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize(
    ("url", "allow_http", "refused"),
    [
        ("https://example.com/hook", False, False),
        ("http://example.com/hook", False, True),
        ("http://example.com/hook", True, False),
        ("ftp://example.com/", True, True),
    ],
)
def test_url_rules(url: str, allow_http: bool, refused: bool) -> None:
    assert (url_refusal(url, allow_http=allow_http) is not None) is refused


@pytest.mark.parametrize(
    "url",
    [
        "https://127.0.0.1/hook",
        "https://[::1]/hook",
        "https://[::ffff:127.0.0.1]/",
        "https://169.254.169.254/latest/meta-data/",
        "https://localhost/hook",  # a name that resolves to loopback
    ],
)
async def test_registration_refuses_private_targets(url: str) -> None:
    assert await registration_refusal(url, allow_http=False, allow_private=False) is not None
    assert await registration_refusal(url, allow_http=False, allow_private=True) is None


async def test_registration_accepts_a_public_literal() -> None:
    assert (
        await registration_refusal("https://93.184.216.34/hook", allow_http=False, allow_private=False)
        is None
    )


@pytest.mark.parametrize(
    "url",
    [
        "https://\U0001fbf1\U0001fbf2\U0001fbf7.0.0.1:18181/",  # segmented digits, folded to 127.0.0.1
        "https://\uff11\uff12\uff17.0.0.1/",  # fullwidth digits
        "https://127\u30020.0.1/",  # ideographic full stop
        "https://[fec0::1]/",  # old site-local IPv6
    ],
)
async def test_hosts_are_checked_as_aiohttp_will_connect_to_them(url: str) -> None:
    assert await registration_refusal(url, allow_http=False, allow_private=False) is not None
    from hookline.shared.outbound.delivery import DeliveryClient

    client = DeliveryClient(max_connections=1, user_agent="t", allow_http=False, allow_private=False)
    assert client.refusal(url) is not None
