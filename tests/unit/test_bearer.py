"""The bearer check every API and /metrics use: the scheme in any case, one of several tokens."""

from __future__ import annotations

import pytest

from hookline.shared.runtime.bearer import presents_token

ADMIN = "admin-token-0123456789"
METRICS = "metrics-token-0123456789"


@pytest.mark.parametrize(
    ("header", "accepted"),
    [
        (f"Bearer {ADMIN}", True),
        (f"bearer {METRICS}", True),
        (f"BEARER  {METRICS} ", True),
        (f"Basic {ADMIN}", False),
        (ADMIN, False),
        (f"Bearer {ADMIN[:-1]}", False),
        (f"Bearer {ADMIN}{METRICS}", False),
        ("Bearer ", False),
        ("", False),
    ],
)
def test_the_header_must_carry_one_of_the_tokens(header: str, accepted: bool) -> None:
    assert presents_token(header, (ADMIN, METRICS)) is accepted


def test_no_token_is_accepted_when_none_is_configured() -> None:
    assert presents_token("Bearer ", ()) is False
    assert presents_token("Bearer ", ("",)) is False
