"""The outcome of an attempt, from its status or error: the table in DESIGN.md "The delivery"."""

from __future__ import annotations

import pytest

from hookline.dispatcher.outcome import ErrorKind, Outcome, classify


@pytest.mark.parametrize(
    ("status", "error", "expected"),
    [
        (200, None, Outcome.SUCCESS),
        (201, None, Outcome.SUCCESS),
        (204, None, Outcome.SUCCESS),
        (299, None, Outcome.SUCCESS),
        (408, None, Outcome.RETRY),
        (429, None, Outcome.RETRY),
        (500, None, Outcome.RETRY),
        (502, None, Outcome.RETRY),
        (503, None, Outcome.RETRY),
        (504, None, Outcome.RETRY),
        (599, None, Outcome.RETRY),
        (410, None, Outcome.DISABLE),
        (400, None, Outcome.PERMANENT),
        (401, None, Outcome.PERMANENT),
        (403, None, Outcome.PERMANENT),
        (404, None, Outcome.PERMANENT),
        (413, None, Outcome.PERMANENT),
        (422, None, Outcome.PERMANENT),
        (301, None, Outcome.PERMANENT),
        (302, None, Outcome.PERMANENT),
        (307, None, Outcome.PERMANENT),
        (100, None, Outcome.PERMANENT),
        (None, ErrorKind.TIMEOUT, Outcome.RETRY),
        (None, ErrorKind.DNS, Outcome.RETRY),
        (None, ErrorKind.CONNECT, Outcome.RETRY),
        (None, ErrorKind.TLS, Outcome.RETRY),
        (None, ErrorKind.NETWORK, Outcome.RETRY),
        (None, ErrorKind.PROTOCOL, Outcome.RETRY),
        (None, ErrorKind.REFUSED_TARGET, Outcome.PERMANENT),
        (None, ErrorKind.INVALID_URL, Outcome.PERMANENT),
    ],
)
def test_classify(status: int | None, error: ErrorKind | None, expected: Outcome) -> None:
    assert classify(status, error) is expected
